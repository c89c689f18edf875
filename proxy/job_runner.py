"""Job sequencing: each model runs its jobs one at a time, in order; different models run theirs
side by side. Part of the controller's state (called only from its task): it decides when a job
starts and finishes and asks the Effects for the work in between."""
from __future__ import annotations

import logging

from proxy import events as ev
from proxy.config import ProxyConfig
from proxy.jobs import Job, JobStatus, JobStore, JobType, Trigger
from proxy.model_state import ModelState, ModelStatus
from proxy.router import ReplicaState
from server.protocol import APIError

log = logging.getLogger("tandem.proxy")


class JobRunner:
    def __init__(self, models: dict[str, ModelState], config: ProxyConfig, effects: ev.Effects, store: JobStore,
                 clock):
        self.models, self.config, self.effects, self.store, self.clock = models, config, effects, store, clock
        self.jobs: dict[str, Job] = {}  # unfinished jobs
        self.notes: dict[str, str] = {}  # why the proxy itself submitted a job; kept in its final message

    def submit(self, m: ModelState, type_: JobType, trigger: Trigger, note: str = "") -> Job:
        job = Job.new(type_, m.name, trigger, self.clock())
        job.message = note
        if note:
            self.notes[job.id] = note
        self.jobs[job.id] = job
        self.store.save(job)
        m.queue.append(job)
        log.info("job %s: %s %s queued (%s)", job.id, type_.value, m.name, trigger.value, extra={"model": m.name})
        self.advance(m)
        return job

    def cancel(self, job: Job) -> None:
        """Only for a queued job."""
        self.models[job.model].queue.remove(job)
        self.settle(job, JobStatus.cancelled, "cancelled before it started")
        self.advance_all()  # a load that waited for this unload submits another

    def advance(self, m: ModelState) -> None:
        """Starts the model's next job if none runs; re-checks a load waiting for its group."""
        if m.current is None and m.queue:
            m.current = m.queue.popleft()
            m.current.start(self.clock())
            self.store.save(m.current)
            self._begin_load(m) if m.current.type is JobType.load else self._begin_unload(m)
        elif m.current is not None and m.waiting_for_group:
            self._begin_load(m)

    def advance_all(self) -> None:
        """Loads that already wait for their exclusive group go first, oldest first: a job that was
        queued behind a member's unload must not take the group from the load that unload makes way for."""
        def order(m: ModelState) -> tuple[bool, float]:
            return (not m.waiting_for_group, m.current.started_at if m.waiting_for_group else 0.0)
        for m in sorted(self.models.values(), key=order):
            self.advance(m)

    def _begin_load(self, m: ModelState) -> None:
        if m.fully_loaded:
            self.finish(m, JobStatus.succeeded, f"model {m.name!r} is already loaded; nothing to do")
            return
        blockers = self._group_blockers(m)
        if blockers:
            m.waiting_for_group = True
            group = m.profile.group
            for other in blockers:
                if not other.pending(JobType.unload):
                    if other.status is ModelStatus.ready and m.current.trigger is not Trigger.restore:
                        m.displaced.append(other.name)
                    self.submit(other, JobType.unload, Trigger.exclusive,
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
            self.finish(m, JobStatus.succeeded, f"model {m.name!r} is not loaded; nothing to do")
            return
        m.status, m.stopping, m.drain_cancelled = ModelStatus.unloading, False, 0
        for r in m.pool.replicas:
            if r.state is ReplicaState.ready:
                r.state = ReplicaState.draining
        if m.profile.autoload and m.pool.queue_depth and not m.removed and not m.pending(JobType.load):
            self.submit(m, JobType.load, Trigger.autoload, "requests waited for it while it unloaded")
        elif not m.pending(JobType.load):
            m.pool.fail_waiters(APIError(503, f"model {m.name!r} is being unloaded"))
        shutdown = self.config.settings.shutdown_drain_timeout
        m.drain_timeout = shutdown if m.current.trigger is Trigger.shutdown and shutdown is not None \
            else m.profile.drain_timeout
        self.effects.call_later(m.drain_timeout, ev.DrainTimeout(m.current.id))
        self.maybe_stop(m)

    def maybe_stop(self, m: ModelState) -> None:
        """An unloading model stops once its last in-flight request is done."""
        if m.status is ModelStatus.unloading and not m.stopping and m.pool.in_flight == 0:
            self.stop(m)

    def stop(self, m: ModelState) -> None:
        m.stopping = True
        draining = [r for r in m.pool.replicas if r.state is ReplicaState.draining]
        self.effects.stop_replicas(m.name, m.current.id, draining, m.profile.stop_grace)

    def finish(self, m: ModelState, status: JobStatus, message: str, error: str | None = None,
               log_tail: list[str] | None = None) -> None:
        """Ends the model's current job and starts whatever can start now. A load that ends
        cancelled or failed loads back what it unloaded from its exclusive group."""
        job, m.current, m.waiting_for_group = m.current, None, False
        displaced, m.displaced = m.displaced, []
        undone = job.type is JobType.load and status in (JobStatus.cancelled, JobStatus.failed)
        if undone and displaced:
            message += f"; loading back what it unloaded: {', '.join(displaced)}"
        self.settle(job, status, message, error, log_tail)
        for name in displaced if undone else ():
            other = self.models.get(name)
            if other is not None and not other.removed and not other.pending(JobType.load):
                self.submit(other, JobType.load, Trigger.restore,
                            f"the load of {m.name!r} that unloaded it was {status.value} (job {job.id})")
        self.advance_all()

    def settle(self, job: Job, status: JobStatus, message: str, error: str | None = None,
               log_tail: list[str] | None = None) -> None:
        note = self.notes.pop(job.id, None)
        job.finish(status, self.clock(), f"{message} ({note})" if note else message, error, log_tail)
        self.store.save(job)
        self.jobs.pop(job.id, None)
        level = logging.WARNING if status is JobStatus.failed else logging.INFO
        log.log(level, "job %s: %s %s %s: %s", job.id, job.type.value, job.model, status.value, error or message,
                extra={"model": job.model})

    def interrupt(self, reason: str) -> None:
        """At shutdown: the running jobs failed, the queued ones cancelled."""
        for m in self.models.values():
            if m.current is not None:
                self.settle(m.current, JobStatus.failed, "interrupted", error=f"interrupted: {reason}")
                m.current = None
            while m.queue:
                self.settle(m.queue.popleft(), JobStatus.cancelled, "interrupted", error=f"interrupted: {reason}")
