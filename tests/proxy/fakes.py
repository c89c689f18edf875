"""A controller driven by hand: fake effects that record what was asked, and helpers to answer."""
from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

from proxy import events as ev
from proxy.config import Profile, ProxyConfig, ProxySettings
from proxy.controller import Controller
from proxy.jobs import Job, JobStore, JobType, Trigger
from proxy.router import Waiter


class FakeEffects:
    def __init__(self):
        self.loads: list[tuple[Job, str, list[int]]] = []
        self.stops: list[tuple[str, str | None, list]] = []
        self.load_cancels: list[str] = []
        self.cancelled: list = []
        self.timers: list[tuple[float, object]] = []

    def start_load(self, job, profile, indices):
        self.loads.append((job, profile.name, indices))

    def cancel_load(self, job_id):
        self.load_cancels.append(job_id)

    def stop_replicas(self, model, job_id, replicas, grace):
        self.stops.append((model, job_id, list(replicas)))

    def cancel_leases(self, leases, reason):
        self.cancelled += [(lease, reason) for lease in leases]

    def call_later(self, delay, event):
        self.timers.append((delay, event))


def profile(name: str, parallel: int = 2, replicas: int = 1, **kw) -> Profile:
    return Profile(name=name, args=["-m", f"/models/{name}", "-np", str(parallel)], replicas=replicas, **kw)


class Harness:
    """A Controller with fake effects, an in-memory store and a clock the test moves."""

    def __init__(self, *profiles: Profile, groups: dict | None = None, queue_limit: int = 4):
        self.loop = asyncio.new_event_loop()
        self.now = 1000.0
        self.fx = FakeEffects()
        self.store = JobStore(sqlite3.connect(":memory:"))
        settings = ProxySettings(groups=groups or {}, queue_limit=queue_limit)
        config = ProxyConfig(settings, {p.name: p for p in profiles}, Path("/nonexistent/proxy.yaml"))
        self.s = Controller(config, self.fx, self.store, clock=lambda: self.now)

    def close(self) -> None:
        self.loop.close()

    def submit(self, type_: str, model: str, trigger: Trigger = Trigger.api) -> Job:
        reply = self.loop.create_future()
        self.s.handle(ev.SubmitJob(JobType(type_), model, reply, trigger))
        return reply.result()

    def job(self, job_id: str) -> Job:
        return self.store.get(job_id)

    def cancel(self, job_id: str) -> asyncio.Future:
        reply = self.loop.create_future()
        self.s.handle(ev.CancelJob(job_id, reply))
        return reply

    def acquire(self, model: str) -> asyncio.Future:
        waiter = Waiter(model, self.loop.create_future())
        self.s.handle(ev.Acquire(waiter))
        return waiter.future

    def finish_load(self, model: str, ports=(9000,), slots: int = 2, pid0: int = 100) -> None:
        """Answers the pending start_load for `model` with healthy replicas."""
        job, name, indices = next(x for x in reversed(self.fx.loads) if x[1] == model)
        started = [ev.StartedReplica(i, ports[k % len(ports)] + i, pid0 + i, slots, None, None)
                   for k, i in enumerate(indices)]
        self.s.handle(ev.LoadDone(job.id, model, replicas=started))

    def finish_stop(self, model: str) -> None:
        name, job_id, replicas = next(x for x in reversed(self.fx.stops) if x[0] == model)
        self.s.handle(ev.StopDone(model, job_id, replicas))
