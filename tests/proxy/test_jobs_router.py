"""Job records in SQLite, and the slot pool on its own."""
from __future__ import annotations

import asyncio
import sqlite3

import pytest

from proxy.jobs import Job, JobStatus, JobStore, JobType
from proxy.router import Pool, Replica, Waiter


def test_jobs_list_newest_first_with_filters_and_survive_reopening(tmp_path):
    db_path = tmp_path / "proxy.db"
    store = JobStore(sqlite3.connect(db_path))
    jobs = [Job.new(JobType.load, m, now=1.0) for m in ("a", "b", "a")]  # same second: insertion order decides
    for job in jobs:
        store.save(job)
    jobs[0].start(2.0)
    jobs[0].finish(JobStatus.succeeded, 5.0, "done")
    store.save(jobs[0])
    reopened = JobStore(sqlite3.connect(db_path))
    assert [j.id for j in reopened.list()] == [j.id for j in reversed(jobs)]
    assert [j.id for j in reopened.list(model="a", status=JobStatus.succeeded)] == [jobs[0].id]
    assert reopened.get(jobs[0].id).duration_s == 3.0


def test_recover_fails_running_and_cancels_queued_jobs():
    store = JobStore(sqlite3.connect(":memory:"))
    running, queued = Job.new(JobType.load, "a"), Job.new(JobType.unload, "a")
    running.start(1.0)
    store.save(running)
    store.save(queued)
    store.recover("the proxy stopped")
    assert store.get(running.id).status is JobStatus.failed
    assert store.get(running.id).error == "interrupted: the proxy stopped"
    assert store.get(queued.id).status is JobStatus.cancelled


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def test_pool_fills_the_least_busy_replica_in_fifo_order(loop):
    pool = Pool("m", limit=1, replicas=[Replica("m", 0, 1, 10, slots_total=1), Replica("m", 1, 2, 11, slots_total=2)])
    waiters = [Waiter("m", loop.create_future()) for _ in range(5)]
    for w in waiters:
        pool.admit(w)
        pool.dispatch()
    granted = [w.future.result().replica.index for w in waiters[:3]]
    assert granted == [0, 1, 1] and not waiters[3].future.done()
    assert waiters[4].future.exception().status == 429  # queue limit 1: one waits, the next is refused
