"""The proxy's controller, its one state-owning task: jobs, models, replicas and waiting requests.

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
from proxy.job_runner import JobRunner
from proxy.jobs import Job, JobStatus, JobStore, JobType, Trigger
from proxy.model_state import ModelState, ModelStatus
from proxy.process import exit_reason
from proxy.router import Lease, Pool, Replica, ReplicaState, Waiter
from server.protocol import APIError

log = logging.getLogger("tandem.proxy")


RETRY_AFTER_S = 5  # what a request refused while the proxy drains is told to wait (a restarted proxy's load)


def shutting_down() -> APIError:
    """The answer to a request the draining proxy will not serve: new ones, and those still waiting
    for a slot."""
    return APIError(503, "the proxy is shutting down: its models are draining",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


class Controller:
    def __init__(self, config: ProxyConfig, effects: ev.Effects, store: JobStore, clock=time.time):
        self.config, self.effects, self.store, self.clock = config, effects, store, clock
        self.models: dict[str, ModelState] = {}
        self.runner = JobRunner(self.models, config, effects, store, clock)
        self.events: asyncio.Queue = asyncio.Queue()
        self.draining = False  # begin_drain was called
        self._add_profiles(config)

    @property
    def jobs(self) -> dict[str, Job]:
        """Unfinished jobs by id."""
        return self.runner.jobs

    # -- called by request handlers, on the event loop ------------------------------------------

    def post(self, event: object) -> None:
        self.events.put_nowait(event)

    async def run(self) -> None:
        while True:
            event = await self.events.get()
            try:
                self.handle(event)
            except Exception:  # a bug in one decision must not stop the proxy
                log.exception("controller failed on %r", event)

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
        _answer(e.reply, self.runner.submit(m, e.type, e.trigger).model_copy(deep=True))

    def _on_CancelJob(self, e: ev.CancelJob) -> None:
        job = self.jobs.get(e.job_id) or self.store.get(e.job_id)
        if job is None:
            _answer(e.reply, error=APIError(404, f"job {e.job_id!r} not found", "not_found_error"))
        elif job.status is JobStatus.queued:
            self.runner.cancel(job)
            _answer(e.reply, job.model_copy(deep=True))
        elif job.status is JobStatus.running and job.type is JobType.load:
            self._cancel_load(self.models[job.model], e.reply)
        elif job.status is JobStatus.running:
            _answer(e.reply, error=APIError(409, f"job {job.id} is a running unload, which cannot be undone: its "
                                                 "servers are already draining or stopping; submit a load job "
                                                 "(it runs once the unload is done)", "invalid_request_error"))
        else:
            _answer(e.reply, error=APIError(409, f"job {job.id} is {job.status.value}; only a queued job or a "
                                                 "running load can be cancelled", "invalid_request_error"))

    def _cancel_load(self, m: ModelState, reply: asyncio.Future | None) -> None:
        """A load still waiting for its exclusive group has started nothing and ends now. One that
        started servers ends, and is answered, once the supervisor has stopped them (LoadCancelled)."""
        m.cancels.append(reply)
        if m.waiting_for_group:
            self._end_cancelled_load(m, "cancelled while it waited for its exclusive group")
        elif len(m.cancels) == 1:
            self.effects.cancel_load(m.current.id)
            m.current.message = "cancelling: stopping the server(s) it started"
            self.store.save(m.current)

    def _on_Acquire(self, e: ev.Acquire) -> None:
        w = e.waiter
        m = self.models.get(w.model)
        if m is None or m.removed:
            w.future.set_exception(self.unknown_model(w.model))
            return
        if w.gone:
            return
        if self.draining:  # it came in as the signal did
            w.future.set_exception(shutting_down())
            return
        m.idle_stamp += 1
        if m.status is ModelStatus.ready or m.pending(JobType.load):
            m.pool.admit(w)
            m.pool.dispatch()
        elif m.profile.autoload:  # an unloading model loads again once its unload is done, as llama-swap does
            self.runner.submit(m, JobType.load, Trigger.autoload)
            m.pool.admit(w)
        elif m.status is ModelStatus.unloading:
            w.future.set_exception(APIError(503, f"model {m.name!r} is being unloaded"))
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
        self.runner.maybe_stop(m)
        self._arm_idle(m)

    def _on_ReplicaStarting(self, e: ev.ReplicaStarting) -> None:
        m = self.models.get(e.model)
        if m is None or m.current is None or m.current.id != e.job_id:
            return
        m.pool.replicas.append(Replica(m.name, e.index, e.port, e.pid, slots_total=0, state=ReplicaState.starting))
        m.pool.replicas.sort(key=lambda r: r.index)

    def _on_LoadDone(self, e: ev.LoadDone) -> None:
        m = self.models[e.model]
        job = m.current
        assert job is not None and job.id == e.job_id, (job, e.job_id)
        m.pool.forget_starting()
        if e.error:
            m.status = ModelStatus.ready if m.pool.ready else ModelStatus.unloaded
            m.last_error = e.error
            self.runner.finish(m, JobStatus.failed, "load failed", error=e.error, log_tail=e.log_tail)
            self._answer_cancels(m, job)
            self._refuse_waiters_unless_loading(m, f"model {m.name!r} failed to load (job {job.id}): {e.error}")
            return
        for s in e.replicas:
            m.pool.replicas.append(Replica(m.name, s.index, s.port, s.pid, s.slots_total, s.devices, s.handle))
        m.pool.replicas.sort(key=lambda r: r.index)
        m.status, m.last_error = ModelStatus.ready, None
        if job.trigger is not Trigger.restart:
            m.restarts = 0
        m.pool.dispatch()  # before the next job starts: requests that waited for this load get served
        ports = ", ".join(str(s.port) for s in e.replicas)
        self.runner.finish(m, JobStatus.succeeded, f"loaded {len(e.replicas)} replica(s) in "
                           f"{self.clock() - job.started_at:.1f} s (port {ports})", log_tail=e.log_tail)
        self._answer_cancels(m, job)
        self._arm_idle(m)

    def _on_LoadCancelled(self, e: ev.LoadCancelled) -> None:
        m = self.models[e.model]
        job = m.current
        assert job is not None and job.id == e.job_id, (job, e.job_id)
        m.pool.forget_starting()
        m.status = ModelStatus.ready if m.pool.ready else ModelStatus.unloaded
        stopped = (f"stopped the server(s) it started (pid {', '.join(map(str, e.stopped))})" if e.stopped
                   else "no server had started")
        self._end_cancelled_load(m, f"cancelled while loading; {stopped}", e.log_tail)

    def _end_cancelled_load(self, m: ModelState, message: str, log_tail: list[str] | None = None) -> None:
        job = m.current
        self.runner.finish(m, JobStatus.cancelled, message, log_tail=log_tail)
        self._answer_cancels(m, job)
        self._refuse_waiters_unless_loading(m, f"model {m.name!r} is not loaded: its load job {job.id} was cancelled")

    def _answer_cancels(self, m: ModelState, job: Job) -> None:
        """Answers the DELETE /jobs calls waiting for m's load, which has just ended as `job` says."""
        replies, m.cancels = m.cancels, []
        for reply in replies:
            if job.status is JobStatus.cancelled:
                _answer(reply, job.model_copy(deep=True))
            else:
                _answer(reply, error=APIError(409, f"job {job.id} {job.status.value} before it could be cancelled",
                                              "invalid_request_error"))

    def _refuse_waiters_unless_loading(self, m: ModelState, message: str) -> None:
        """After a load ended without making m ready: its waiters get 503, unless another load is coming."""
        if not m.pool.ready and not m.pending(JobType.load):
            m.pool.fail_waiters(APIError(503, message))

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
                        f"{m.drain_timeout:g} s drain timeout were cancelled")
        self.runner.finish(m, JobStatus.succeeded, message)
        if m.removed and m.current is None and not m.queue:
            del self.models[m.name]

    def _on_ReplicaExited(self, e: ev.ReplicaExited) -> None:
        m = self.models.get(e.model)
        r = m.pool.find(e.pid) if m else None
        if r is not None and r.state is ReplicaState.ready:
            self._replica_failed(m, r, f"replica {r.index} (pid {e.pid}) {exit_reason(e.returncode, e.last_line)}")

    def _on_DrainTimeout(self, e: ev.DrainTimeout) -> None:
        job = self.jobs.get(e.job_id)
        m = self.models.get(job.model) if job else None
        if m is None or m.current is not job or m.stopping:
            return
        leases = m.pool.leases()
        m.drain_cancelled = len(leases)
        self.effects.cancel_leases(leases, f"model {m.name!r} was unloaded; the request did not finish within "
                                           f"the {m.drain_timeout:g} s drain timeout")
        self.runner.stop(m)

    def _on_IdleCheck(self, e: ev.IdleCheck) -> None:
        m = self.models.get(e.model)
        if m is not None and m.idle_stamp == e.stamp and m.idle:
            log.info("model %s idle for %g s: unloading", m.name, m.profile.ttl, extra={"model": m.name})
            self.runner.submit(m, JobType.unload, Trigger.idle_ttl)

    def _on_Reload(self, e: ev.Reload) -> None:
        self.config = self.runner.config = e.config
        self._add_profiles(e.config)
        for m in list(self.models.values()):
            if m.name not in e.config.profiles and not m.removed:
                m.removed = True
                if m.status is ModelStatus.unloaded and m.current is None and not m.queue:
                    del self.models[m.name]
                else:
                    self.runner.submit(m, JobType.unload, Trigger.api)

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
                self.runner.submit(m, JobType.load, Trigger.restart,
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

    def begin_drain(self) -> None:
        """The proxy is stopping: requests waiting for a slot, which have not started, are told to
        come back as new ones are, and from now on none waits or starts a load (the shutdown's
        unloads would otherwise autoload the models for them, and the proxy exit with them unanswered)."""
        self.draining = True
        for m in self.models.values():
            m.pool.fail_waiters(shutting_down())

    def interrupt(self, reason: str) -> None:
        """At shutdown: settles unfinished jobs and answers waiting requests (the supervisor then
        stops every server)."""
        self.runner.interrupt(reason)
        for m in self.models.values():
            error = APIError(503, f"the proxy is shutting down ({reason})")
            m.pool.fail_waiters(error)
            for reply in m.cancels:
                _answer(reply, error=error)


def _answer(reply: asyncio.Future | None, result: object = None, error: Exception | None = None) -> None:
    if reply is None or reply.done():
        return
    reply.set_exception(error) if error is not None else reply.set_result(result)
