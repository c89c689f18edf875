"""Job records (the wire shape of /jobs) and their SQLite store.

A job changes what is loaded. Its record is saved on every status change, so a restarted proxy
still answers GET /jobs for everything it did; `recover` settles the records of jobs that the
previous proxy process left unfinished.
"""
from __future__ import annotations

import sqlite3
import time
import uuid
from enum import Enum

from pydantic import BaseModel, ConfigDict


class JobType(str, Enum):
    load = "load"
    unload = "unload"


class JobStatus(str, Enum):
    queued = "queued"
    running = "running"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"

    @property
    def finished(self) -> bool:
        return self in (JobStatus.succeeded, JobStatus.failed, JobStatus.cancelled)


class Trigger(str, Enum):
    """Who asked for a job: a client, or the proxy itself (and why)."""
    api = "api"
    autoload = "autoload"  # a request for an unloaded model with `autoload: true`
    idle_ttl = "idle_ttl"
    restart = "restart"  # a replica failed and the profile says `restart: on-failure`
    exclusive = "exclusive"  # another member of an exclusive group is loading
    shutdown = "shutdown"  # the proxy is stopping (SIGTERM or SIGINT): each model drains, then stops
    restore = "restore"  # a swap in an exclusive group was cancelled or failed: what it unloaded loads back


class JobRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: JobType
    model: str


class Job(BaseModel):
    id: str
    type: JobType
    model: str
    status: JobStatus = JobStatus.queued
    trigger: Trigger = Trigger.api
    message: str = ""
    created_at: float
    started_at: float | None = None
    finished_at: float | None = None
    duration_s: float | None = None  # running time: started_at to finished_at
    error: str | None = None
    log_tail: list[str] = []

    @classmethod
    def new(cls, type_: JobType, model: str, trigger: Trigger = Trigger.api, now: float | None = None) -> "Job":
        return cls(id=uuid.uuid4().hex, type=type_, model=model, trigger=trigger,
                   created_at=time.time() if now is None else now)

    def start(self, now: float) -> None:
        assert self.status is JobStatus.queued, self.status
        self.status, self.started_at = JobStatus.running, now

    def finish(self, status: JobStatus, now: float, message: str | None = None, error: str | None = None,
               log_tail: list[str] | None = None) -> None:
        assert status.finished and not self.status.finished, (self.status, status)
        self.status, self.finished_at = status, now
        if self.started_at is not None:
            self.duration_s = round(now - self.started_at, 3)
        if message is not None:
            self.message = message
        self.error = error
        if log_tail is not None:
            self.log_tail = log_tail


class JobStore:
    """Job records in SQLite. Called on the event loop: each write is one small transaction."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db
        db.execute("CREATE TABLE IF NOT EXISTS jobs (id TEXT PRIMARY KEY, model TEXT NOT NULL, "
                   "status TEXT NOT NULL, created_at REAL NOT NULL, seq INTEGER NOT NULL, body TEXT NOT NULL)")
        db.execute("CREATE INDEX IF NOT EXISTS jobs_order ON jobs (created_at DESC, seq DESC)")
        db.commit()

    def save(self, job: Job) -> None:
        with self.db:
            self.db.execute(
                "INSERT INTO jobs (id, model, status, created_at, seq, body) VALUES (?, ?, ?, ?, "
                "(SELECT COALESCE(MAX(seq), 0) + 1 FROM jobs), ?) "
                "ON CONFLICT(id) DO UPDATE SET status = excluded.status, body = excluded.body",
                (job.id, job.model, job.status.value, job.created_at, job.model_dump_json()))

    def get(self, job_id: str) -> Job | None:
        row = self.db.execute("SELECT body FROM jobs WHERE id = ?", (job_id,)).fetchone()
        return Job.model_validate_json(row[0]) if row else None

    def list(self, model: str | None = None, status: JobStatus | None = None, limit: int = 100) -> list[Job]:
        """Newest first."""
        sql, params = "SELECT body FROM jobs WHERE 1=1", []
        if model is not None:
            sql, params = sql + " AND model = ?", params + [model]
        if status is not None:
            sql, params = sql + " AND status = ?", params + [status.value]
        rows = self.db.execute(sql + " ORDER BY created_at DESC, seq DESC LIMIT ?", (*params, limit)).fetchall()
        return [Job.model_validate_json(r[0]) for r in rows]

    def counts(self) -> dict[JobStatus, int]:
        rows = self.db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()
        found = {JobStatus(s): n for s, n in rows}
        return {s: found.get(s, 0) for s in JobStatus}

    def recover(self, reason: str, now: float | None = None) -> list[Job]:
        """Settles jobs left unfinished by a proxy that died: running ones failed, queued ones cancelled."""
        now = time.time() if now is None else now
        settled = []
        for status, outcome in ((JobStatus.running, JobStatus.failed), (JobStatus.queued, JobStatus.cancelled)):
            for job in self.list(status=status, limit=1_000_000):
                job.finish(outcome, now, error=f"interrupted: {reason}")
                self.save(job)
                settled.append(job)
        return settled
