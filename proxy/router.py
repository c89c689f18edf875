"""Slot-aware routing for one model: its replicas, the requests they serve, and a FIFO of waiters.

A replica never gets more concurrent requests than it has slots; a request that finds every slot
busy waits in the pool's FIFO and is granted the least-busy replica as soon as one frees. Pure data:
the controller owns each Pool and calls it from its one task, so there are no locks.
"""
from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from server.protocol import APIError


class ReplicaState(str, Enum):
    starting = "starting"  # its process runs and its model loads; a load job is bringing it up
    ready = "ready"  # takes new requests
    draining = "draining"  # its model is unloading: in-flight requests finish, no new ones
    failed = "failed"  # exited or broke mid-stream; being stopped and removed


@dataclass(eq=False)
class Replica:
    model: str
    index: int
    port: int
    pid: int
    slots_total: int
    devices: str | None = None
    handle: Any = None  # the supervisor's process object; opaque here
    state: ReplicaState = ReplicaState.ready
    leases: set["Lease"] = field(default_factory=set)

    @property
    def busy(self) -> int:
        return len(self.leases)

    @property
    def serving(self) -> bool:
        """Its server is up: it takes requests, or finishes the ones it has."""
        return self.state in (ReplicaState.ready, ReplicaState.draining)

    @property
    def has_free_slot(self) -> bool:
        return self.state is ReplicaState.ready and self.busy < self.slots_total

    def snapshot(self) -> dict:
        return {"index": self.index, "pid": self.pid, "port": self.port, "devices": self.devices,
                "state": self.state.value, "slots_busy": self.busy, "slots_total": self.slots_total}


@dataclass(eq=False)
class Lease:
    """One request's hold on one slot of a replica, from grant to release."""
    replica: Replica
    task: asyncio.Task | None  # the request's task, cancelled when an unload's drain time runs out
    cancel_reason: str | None = None
    released: bool = False

    def cancel(self, reason: str) -> None:
        self.cancel_reason = reason
        if self.task is not None:
            self.task.cancel()


@dataclass(eq=False)
class Waiter:
    model: str
    future: asyncio.Future  # resolves to a Lease, or raises APIError
    task: asyncio.Task | None = None
    enqueued_at: float = field(default_factory=time.monotonic)

    @property
    def gone(self) -> bool:
        return self.future.done()  # cancelled by a disconnect, or already answered


@dataclass(eq=False)
class Pool:
    model: str
    limit: int  # most waiters; one more is refused with 429
    replicas: list[Replica] = field(default_factory=list)
    waiters: deque[Waiter] = field(default_factory=deque)

    @property
    def ready(self) -> list[Replica]:
        return [r for r in self.replicas if r.state is ReplicaState.ready]

    @property
    def in_flight(self) -> int:
        return sum(r.busy for r in self.replicas)

    @property
    def queue_depth(self) -> int:
        return sum(not w.gone for w in self.waiters)

    def leases(self) -> list[Lease]:
        return [lease for r in self.replicas for lease in r.leases]

    def find(self, pid: int) -> Replica | None:
        return next((r for r in self.replicas if r.pid == pid), None)

    def pick(self) -> Replica | None:
        """The least-busy ready replica with a free slot (lowest index on a tie)."""
        free = [r for r in self.replicas if r.has_free_slot]
        return min(free, key=lambda r: (r.busy, r.index), default=None)

    def admit(self, waiter: Waiter) -> None:
        """Queues the waiter, refusing it with 429 when it would wait and the queue is full."""
        self.waiters = deque(w for w in self.waiters if not w.gone)
        if self.pick() is None and len(self.waiters) >= self.limit:
            waiter.future.set_exception(APIError(
                429, f"model {self.model!r}: all slots are busy and {len(self.waiters)} request(s) already wait; "
                     "retry later", "rate_limit_error"))
            return
        self.waiters.append(waiter)

    def dispatch(self) -> list[Lease]:
        """Grants waiters, oldest first, while a replica has a free slot."""
        granted = []
        while self.waiters:
            replica = self.pick()
            if replica is None:
                break
            waiter = self.waiters.popleft()
            if waiter.gone:
                continue
            lease = Lease(replica, waiter.task)
            replica.leases.add(lease)
            waiter.future.set_result(lease)
            granted.append(lease)
        return granted

    def release(self, lease: Lease) -> bool:
        """False when the lease was already released or its replica is gone."""
        if lease.released:
            return False
        lease.released = True
        if lease.replica in self.replicas and lease in lease.replica.leases:
            lease.replica.leases.discard(lease)
            return True
        return False

    def fail_waiters(self, error: APIError) -> None:
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.gone:
                waiter.future.set_exception(error)

    def forget_starting(self) -> None:
        """The load that was starting replicas has ended: its LoadDone lists the ones that came up."""
        self.replicas = [r for r in self.replicas if r.state is not ReplicaState.starting]

    def remove(self, replica: Replica) -> None:
        if replica in self.replicas:
            self.replicas.remove(replica)
