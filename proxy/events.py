"""What the controller reacts to, and the effects it asks for.

Request handlers and effect tasks post events; the controller's one task handles them in order. The
Effects protocol is everything the controller may do to the outside world; each method returns at
once and reports back later with an event, so a test can drive the controller with a fake.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Protocol

from proxy.config import Profile, ProxyConfig
from proxy.jobs import Job, JobType, Trigger
from proxy.router import Lease, Replica, Waiter


@dataclass
class SubmitJob:
    type: JobType
    model: str
    reply: asyncio.Future | None = None  # resolves to the Job
    trigger: Trigger = Trigger.api


@dataclass
class CancelJob:
    job_id: str
    reply: asyncio.Future | None = None  # resolves to the Job, or raises APIError


@dataclass
class Acquire:
    waiter: Waiter


@dataclass
class Release:
    lease: Lease
    failure: str | None = None  # set when the upstream broke: the replica is marked failed


@dataclass
class StartedReplica:
    index: int
    port: int
    pid: int
    slots_total: int
    devices: str | None
    handle: Any


@dataclass
class ReplicaStarting:
    """A load's server process runs (its pid is known); its model is still loading."""
    job_id: str
    model: str
    index: int
    port: int
    pid: int


@dataclass
class LoadDone:
    job_id: str
    model: str
    replicas: list[StartedReplica] = field(default_factory=list)
    error: str | None = None  # a sentence; nothing of the failed load runs any more
    log_tail: list[str] = field(default_factory=list)


@dataclass
class LoadCancelled:
    """A load stopped at the controller's request (cancel_load); nothing it started runs any more."""
    job_id: str
    model: str
    stopped: list[int] = field(default_factory=list)  # the pids of the servers it had started
    log_tail: list[str] = field(default_factory=list)


@dataclass
class StopDone:
    model: str
    job_id: str | None  # None when a failed replica was stopped outside any job
    replicas: list[Replica]


@dataclass
class ReplicaExited:
    model: str
    pid: int
    returncode: int
    last_line: str


@dataclass
class DrainTimeout:
    job_id: str


@dataclass
class IdleCheck:
    model: str
    stamp: int  # stale when the model was used since the check was armed


@dataclass
class Reload:
    config: ProxyConfig


class Effects(Protocol):
    def start_load(self, job: Job, profile: Profile, indices: list[int]) -> None:
        """Start replicas `indices` (posting ReplicaStarting for each process), wait until healthy
        and checked; post LoadDone (and later ReplicaExited for each replica that exits)."""

    def cancel_load(self, job_id: str) -> None:
        """Stop the load `job_id` runs and every server it started; post LoadCancelled. A load
        that has already ended is left alone (its LoadDone is on its way)."""

    def stop_replicas(self, model: str, job_id: str | None, replicas: list[Replica], grace: float) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds; post StopDone."""

    def cancel_leases(self, leases: list[Lease], reason: str) -> None:
        """Close these in-flight requests (their upstream connections too)."""

    def call_later(self, delay: float, event: object) -> None:
        """Post `event` after `delay` seconds."""
