"""What the controller knows about one configured model: status, replicas (in its Pool), jobs."""
from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from proxy.config import Profile
from proxy.jobs import Job, JobType
from proxy.router import Pool


class ModelStatus(str, Enum):
    unloaded = "unloaded"
    loading = "loading"
    ready = "ready"  # at least one replica takes requests
    unloading = "unloading"
    failed = "failed"  # every replica failed; a restart job may be on its way


@dataclass(eq=False)
class ModelState:
    profile: Profile
    pool: Pool
    status: ModelStatus = ModelStatus.unloaded
    queue: deque[Job] = field(default_factory=deque)  # jobs not yet started, in order
    current: Job | None = None  # the one running job; jobs on one model never overlap
    waiting_for_group: bool = False  # current is a load waiting for exclusive-group members to unload
    stopping: bool = False  # the current unload has asked the supervisor to stop the replicas
    drain_cancelled: int = 0  # requests the current unload cut off at its drain timeout
    drain_timeout: float = 0.0  # the current unload's: the profile's, or the proxy's at shutdown
    restarts: int = 0  # automatic restarts since the last load that was not one
    idle_stamp: int = 0  # bumped on every use; an idle check armed with an older stamp is stale
    last_error: str | None = None
    removed: bool = False  # its profile left the config on reload; dropped once unloaded
    cancels: list[asyncio.Future | None] = field(default_factory=list)  # DELETE /jobs replies awaiting the load's end
    # The exclusive-group members the current load unloaded while they served: loaded back if the
    # load is cancelled or fails, so that a swap is all or nothing.
    displaced: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.profile.name

    def pending(self, type_: JobType) -> bool:
        """A job of this type is running or queued."""
        return (self.current is not None and self.current.type is type_) or any(j.type is type_ for j in self.queue)

    def missing_replicas(self) -> list[int]:
        """Profile replica indices with no ready (or draining) process."""
        live = {r.index for r in self.pool.replicas if r.serving}
        return [i for i in range(len(self.profile.replicas)) if i not in live]

    @property
    def fully_loaded(self) -> bool:
        return self.status is ModelStatus.ready and not self.missing_replicas()

    @property
    def idle(self) -> bool:
        return (self.status is ModelStatus.ready and self.pool.in_flight == 0 and self.pool.queue_depth == 0
                and self.current is None and not self.queue)

    def snapshot(self) -> dict:
        return {"model": self.name, "status": self.status.value, "model_path": self.profile.model,
                "replicas": [r.snapshot() for r in sorted(self.pool.replicas, key=lambda r: r.index)],
                "in_flight": self.pool.in_flight, "queue_depth": self.pool.queue_depth,
                "current_job": self.current.id if self.current else None, "last_error": self.last_error}
