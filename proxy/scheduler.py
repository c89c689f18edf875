"""The proxy's one state-owning task: jobs, models, replicas and waiting requests.

Everything that changes state arrives as an event on one queue and is handled to completion before
the next (no awaits inside `handle`, so no locks). Long work (starting servers, stopping them,
timers) is asked of the Effects object, which reports back with more events. Tests call `handle`
directly with a fake Effects.
"""
from __future__ import annotations

import asyncio
import logging
import time

from proxy import events as ev
from proxy.config import ProxyConfig
from proxy.jobs import Job, JobStatus, JobStore, JobType, Trigger
from proxy.model_state import ModelState, ModelStatus
from proxy.router import Lease, Pool, Replica, ReplicaState, Waiter
from server.protocol import APIError

log = logging.getLogger("tandem.proxy")


class Scheduler:
    def __init__(self, config: ProxyConfig, effects: ev.Effects, store: JobStore, clock=time.time):
        self.config, self.effects, self.store, self.clock = config, effects, store, clock
        self.models: dict[str, ModelState] = {}
        self.jobs: dict[str, Job] = {}  # unfinished jobs
        self.notes: dict[str, str] = {}  # why the proxy itself submitted a job; kept in its final message
        self.events: asyncio.Queue = asyncio.Queue()
        self._add_profiles(config)

    # -- called by request handlers, on the event loop ------------------------------------------

    def post(self, event: object) -> None:
        self.events.put_nowait(event)

    async def run(self) -> None:
        while True:
            event = await self.events.get()
            try:
                self.handle(event)
            except Exception:  # a bug in one decision must not stop the proxy
                log.exception("scheduler failed on %r", event)

    async def submit(self, type_: JobType, model: str, trigger: Trigger = Trigger.api) -> Job:
        reply = asyncio.get_running_loop().create_future()
        self.post(ev.SubmitJob(type_, model, reply, trigger))
        return await reply

    async def cancel(self, job_id: str) -> Job:
        reply = asyncio.get_running_loop().create_future()
        self.post(ev.CancelJob(job_id, reply))
        return await reply

    async def acquire(self, model: str) -> Lease:
        """A slot on a replica of `model`, waiting in its FIFO if need be. Raises APIError when refused."""
        waiter = Waiter(model, asyncio.get_running_loop().create_future(), asyncio.current_task())
        self.post(ev.Acquire(waiter))
        try:
            return await waiter.future
        except asyncio.CancelledError:  # the client left; a lease granted meanwhile goes back
            f = waiter.future
            if f.done() and not f.cancelled() and f.exception() is None:
                self.release(f.result())
            raise

    def release(self, lease: Lease, failure: str | None = None) -> None:
        self.post(ev.Release(lease, failure))

    def unknown_model(self, model: str | None) -> APIError:
        names = ", ".join(sorted(n for n, m in self.models.items() if not m.removed)) or "(none)"
        return APIError(404, f"model {model!r} is not configured; configured models: {names}", "not_found_error")

    # -- decisions --------------------------------------------------------------------------------

    def handle(self, event: object) -> None:
        getattr(self, "_on_" + type(event).__name__)(event)

    def _on_SubmitJob(self, e: ev.SubmitJob) -> None:
        m = self.models.get(e.model)
        if m is None or m.removed:
            _answer(e.reply, error=self.unknown_model(e.model))
            return
        _answer(e.reply, self._submit(m, e.type, e.trigger).model_copy(deep=True))

    def _on_CancelJob(self, e: ev.CancelJob) -> None:
        job = self.jobs.get(e.job_id) or self.store.get(e.job_id)
        if job is None:
            _answer(e.reply, error=APIError(404, f"job {e.job_id!r} not found", "not_found_error"))
        elif job.status is not JobStatus.queued:
            _answer(e.reply, error=APIError(409, f"job {job.id} is {job.status.value}; only a queued job can be "
                                                 "cancelled", "invalid_request_error"))
        else:
            self.models[job.model].queue.remove(job)
            self._settle(job, JobStatus.cancelled, "cancelled before it started")
            _answer(e.reply, job.model_copy(deep=True))
            self._advance_all()  # a load waiting for this unload submits another

    def _on_Acquire(self, e: ev.Acquire) -> None:
        w = e.waiter
        m = self.models.get(w.model)
        if m is None or m.removed:
            w.future.set_exception(self.unknown_model(w.model))
            return
        if w.gone:
            return
        m.idle_stamp += 1
        if m.status is ModelStatus.ready or m.pending(JobType.load):
            m.pool.admit(w)
            m.pool.dispatch()
        elif m.status is ModelStatus.unloading:
            w.future.set_exception(APIError(503, f"model {m.name!r} is being unloaded"))
        elif m.profile.autoload:
            self._submit(m, JobType.load, Trigger.autoload)
            m.pool.admit(w)
        else:
            w.future.set_exception(self._not_loaded(m))

    def _on_Release(self, e: ev.Release) -> None:
        m = self.models.get(e.lease.replica.model)
        if m is None:
            return  # its profile was removed and it is unloaded
        m.pool.release(e.lease)
        if e.failure:
            self._replica_failed(m, e.lease.replica, e.failure)
        m.pool.dispatch()
        self._maybe_stop(m)
        self._arm_idle(m)

    def _on_LoadDone(self, e: ev.LoadDone) -> None:
        m = self.models[e.model]
        job = m.current
        assert job is not None and job.id == e.job_id, (job, e.job_id)
        if e.error:
            m.status = ModelStatus.ready if m.pool.ready else ModelStatus.unloaded
            m.last_error = e.error
            self._finish(m, JobStatus.failed, "load failed", error=e.error, log_tail=e.log_tail)
            if m.status is ModelStatus.unloaded and not m.pending(JobType.load):
                m.pool.fail_waiters(APIError(503, f"model {m.name!r} failed to load (job {job.id}): {e.error}"))
            return
        for s in e.replicas:
            m.pool.replicas.append(Replica(m.name, s.index, s.port, s.pid, s.slots_total, s.devices, s.handle))
        m.pool.replicas.sort(key=lambda r: r.index)
        m.status, m.last_error = ModelStatus.ready, None
        if job.trigger is not Trigger.restart:
            m.restarts = 0
        m.pool.dispatch()  # before the next job starts: requests that waited for this load get served
        ports = ", ".join(str(s.port) for s in e.replicas)
        self._finish(m, JobStatus.succeeded, f"loaded {len(e.replicas)} replica(s) in "
                     f"{self.clock() - job.started_at:.1f} s (port {ports})", log_tail=e.log_tail)
        self._arm_idle(m)

    def _on_StopDone(self, e: ev.StopDone) -> None:
        m = self.models[e.model]
        for r in e.replicas:
            m.pool.remove(r)
        if e.job_id is None or m.current is None or m.current.id != e.job_id:
            return  # a failed replica is gone
        m.status, m.stopping = ModelStatus.unloaded, False
        message = f"unloaded {len(e.replicas)} replica(s) in {self.clock() - m.current.started_at:.1f} s"
        if m.drain_cancelled:
            message += (f"; {m.drain_cancelled} request(s) still running after the "
                        f"{m.profile.drain_timeout:g} s drain timeout were cancelled")
        self._finish(m, JobStatus.succeeded, message)
        if m.removed and m.current is None and not m.queue:
            del self.models[m.name]

    def _on_ReplicaExited(self, e: ev.ReplicaExited) -> None:
        m = self.models.get(e.model)
        r = m.pool.find(e.pid) if m else None
        if r is not None and r.state is ReplicaState.ready:
            detail = f": {e.last_line}" if e.last_line else ""
            self._replica_failed(m, r, f"replica {r.index} (pid {e.pid}) exited with code {e.returncode}{detail}")

    def _on_DrainTimeout(self, e: ev.DrainTimeout) -> None:
        job = self.jobs.get(e.job_id)
        m = self.models.get(job.model) if job else None
        if m is None or m.current is not job or m.stopping:
            return
        leases = m.pool.leases()
        m.drain_cancelled = len(leases)
        self.effects.cancel_leases(leases, f"model {m.name!r} was unloaded; the request did not finish within "
                                           f"the {m.profile.drain_timeout:g} s drain timeout")
        self._stop(m)

    def _on_IdleCheck(self, e: ev.IdleCheck) -> None:
        m = self.models.get(e.model)
        if m is not None and m.idle_stamp == e.stamp and m.idle:
            log.info("model %s idle for %g s: unloading", m.name, m.profile.ttl, extra={"model": m.name})
            self._submit(m, JobType.unload, Trigger.idle_ttl)

    def _on_Reload(self, e: ev.Reload) -> None:
        self.config = e.config
        self._add_profiles(e.config)
        for m in list(self.models.values()):
            if m.name not in e.config.profiles and not m.removed:
                m.removed = True
                if m.status is ModelStatus.unloaded and m.current is None and not m.queue:
                    del self.models[m.name]
                else:
                    self._submit(m, JobType.unload, Trigger.api)

    # -- jobs ---------------------------------------------------------------------------------------

    def _submit(self, m: ModelState, type_: JobType, trigger: Trigger, message: str = "") -> Job:
        job = Job.new(type_, m.name, trigger, self.clock())
        job.message = message
        if message:
            self.notes[job.id] = message
        self.jobs[job.id] = job
        self.store.save(job)
        m.queue.append(job)
        log.info("job %s: %s %s queued (%s)", job.id, type_.value, m.name, trigger.value, extra={"model": m.name})
        self._advance(m)
        return job

    def _advance(self, m: ModelState) -> None:
        """Starts the model's next job if none runs; re-checks a load waiting for its group."""
        if m.current is None and m.queue:
            m.current = m.queue.popleft()
            m.current.start(self.clock())
            self.store.save(m.current)
            self._begin_load(m) if m.current.type is JobType.load else self._begin_unload(m)
        elif m.current is not None and m.waiting_for_group:
            self._begin_load(m)

    def _advance_all(self) -> None:
        for m in list(self.models.values()):
            self._advance(m)

    def _begin_load(self, m: ModelState) -> None:
        if m.fully_loaded:
            self._finish(m, JobStatus.succeeded, f"model {m.name!r} is already loaded; nothing to do")
            return
        blockers = self._group_blockers(m)
        if blockers:
            m.waiting_for_group = True
            group = m.profile.group
            for other in blockers:
                if not other.pending(JobType.unload):
                    self._submit(other, JobType.unload, Trigger.exclusive,
                                 f"making way for {m.name!r} (exclusive group {group!r})")
            message = f"waiting for {', '.join(o.name for o in blockers)} to unload (exclusive group {group!r})"
            if m.current.message != message:
                m.current.message = message
                self.store.save(m.current)
            return
        m.waiting_for_group = False
        if m.status is not ModelStatus.ready:
            m.status = ModelStatus.loading
        self.effects.start_load(m.current, m.profile, m.missing_replicas())

    def _group_blockers(self, m: ModelState) -> list[ModelState]:
        """Other members of m's exclusive group that hold (or are getting) servers. A member whose own
        load is still waiting for the group does not count, so two waiting loads cannot deadlock."""
        group = m.profile.group
        if group is None or not self.config.settings.groups[group].exclusive:
            return []
        return [o for o in self.models.values() if o is not m and o.profile.group == group
                and (o.status is not ModelStatus.unloaded or o.pool.replicas
                     or (o.current is not None and not o.waiting_for_group))]

    def _begin_unload(self, m: ModelState) -> None:
        if m.status in (ModelStatus.unloaded, ModelStatus.failed) and not m.pool.ready:
            m.status = ModelStatus.unloaded
            self._finish(m, JobStatus.succeeded, f"model {m.name!r} is not loaded; nothing to do")
            return
        m.status, m.stopping, m.drain_cancelled = ModelStatus.unloading, False, 0
        for r in m.pool.replicas:
            if r.state is ReplicaState.ready:
                r.state = ReplicaState.draining
        if not m.pending(JobType.load):
            m.pool.fail_waiters(APIError(503, f"model {m.name!r} is being unloaded"))
        self.effects.call_later(m.profile.drain_timeout, ev.DrainTimeout(m.current.id))
        self._maybe_stop(m)

    def _maybe_stop(self, m: ModelState) -> None:
        if m.status is ModelStatus.unloading and not m.stopping and m.pool.in_flight == 0:
            self._stop(m)

    def _stop(self, m: ModelState) -> None:
        m.stopping = True
        draining = [r for r in m.pool.replicas if r.state is ReplicaState.draining]
        self.effects.stop_replicas(m.name, m.current.id, draining, m.profile.stop_grace)

    def _finish(self, m: ModelState, status: JobStatus, message: str, error: str | None = None,
                log_tail: list[str] | None = None) -> None:
        job, m.current, m.waiting_for_group = m.current, None, False
        self._settle(job, status, message, error, log_tail)
        self._advance_all()

    def _settle(self, job: Job, status: JobStatus, message: str, error: str | None = None,
                log_tail: list[str] | None = None) -> None:
        note = self.notes.pop(job.id, None)
        job.finish(status, self.clock(), f"{message} ({note})" if note else message, error, log_tail)
        self.store.save(job)
        self.jobs.pop(job.id, None)
        level = logging.WARNING if status is JobStatus.failed else logging.INFO
        log.log(level, "job %s: %s %s %s: %s", job.id, job.type.value, job.model, status.value, error or message,
                extra={"model": job.model})

    # -- replicas -------------------------------------------------------------------------------------

    def _replica_failed(self, m: ModelState, r: Replica, reason: str) -> None:
        """Stops routing to r and stops its process; restarts it when the profile says so."""
        if r.state is ReplicaState.failed:
            return
        was_draining, r.state = r.state is ReplicaState.draining, ReplicaState.failed
        log.warning("model %s: %s", m.name, reason, extra={"model": m.name})
        self.effects.stop_replicas(m.name, None, [r], m.profile.stop_grace)
        if was_draining:
            return  # the unload carries on without it
        if not m.pool.ready:
            m.status, m.last_error = ModelStatus.failed, reason
        if m.profile.restart == "on-failure" and not m.pending(JobType.load) and not m.pending(JobType.unload):
            if m.restarts < m.profile.restart_limit:
                m.restarts += 1
                self._submit(m, JobType.load, Trigger.restart,
                             f"restart {m.restarts}/{m.profile.restart_limit} after: {reason}")
                return
            log.warning("model %s: restart limit (%d) reached", m.name, m.profile.restart_limit)
        if m.status is ModelStatus.failed and not m.pending(JobType.load):
            m.pool.fail_waiters(APIError(503, f"model {m.name!r} failed: {reason}; POST a load job to start it again"))

    def _arm_idle(self, m: ModelState) -> None:
        if m.profile.ttl > 0 and m.idle:
            m.idle_stamp += 1
            self.effects.call_later(m.profile.ttl, ev.IdleCheck(m.name, m.idle_stamp))

    def _not_loaded(self, m: ModelState) -> APIError:
        why = f" (last error: {m.last_error})" if m.last_error else ""
        return APIError(503, f"model {m.name!r} is not loaded{why}; load it with POST /jobs "
                             f'{{"type": "load", "model": "{m.name}"}}')

    def _add_profiles(self, config: ProxyConfig) -> None:
        for name, profile in config.profiles.items():
            limit = config.queue_limit(profile)
            if name in self.models:
                m = self.models[name]
                m.profile, m.pool.limit, m.removed = profile, limit, False
            else:
                self.models[name] = ModelState(profile, Pool(name, limit))

    # -- read-only views and shutdown ------------------------------------------------------------------

    def running(self) -> list[dict]:
        return [m.snapshot() for m in self.models.values() if m.status is not ModelStatus.unloaded or m.pool.replicas]

    def interrupt(self, reason: str) -> list[Replica]:
        """At shutdown: settles unfinished jobs and returns every replica still to stop."""
        replicas = []
        for m in self.models.values():
            if m.current is not None:
                self._settle(m.current, JobStatus.failed, "interrupted", error=f"interrupted: {reason}")
                m.current = None
            while m.queue:
                self._settle(m.queue.popleft(), JobStatus.cancelled, "interrupted", error=f"interrupted: {reason}")
            m.pool.fail_waiters(APIError(503, f"the proxy is shutting down ({reason})"))
            replicas += m.pool.replicas
        return replicas


def _answer(reply: asyncio.Future | None, result: object = None, error: Exception | None = None) -> None:
    if reply is None or reply.done():
        return
    reply.set_exception(error) if error is not None else reply.set_result(result)
