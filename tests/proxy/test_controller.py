"""The controller's decisions, driven event by event with fake effects (no processes, no HTTP)."""
from __future__ import annotations

import re

import pytest

from proxy import events as ev
from proxy.config import GroupSpec
from proxy.jobs import JobStatus, Trigger
from proxy.model_state import ModelStatus
from server.protocol import APIError
from tests.proxy.fakes import Harness, profile


@pytest.fixture
def h():
    harness = Harness(profile("a"), profile("b", autoload=True), profile("c", restart="on-failure", restart_limit=1))
    yield harness
    harness.close()


def error_of(future) -> APIError:
    assert future.done() and isinstance(future.exception(), APIError), future
    return future.exception()


def test_load_job_starts_replicas_and_succeeds_with_duration(h):
    job = h.submit("load", "a")
    assert re.fullmatch(r"[0-9a-f]{32}", job.id) and job.status is JobStatus.running
    assert [(x[1], x[2]) for x in h.fx.loads] == [("a", [0])]
    h.now += 2.5
    h.finish_load("a")
    done = h.job(job.id)
    assert done.status is JobStatus.succeeded and done.duration_s == 2.5
    assert h.s.models["a"].status is ModelStatus.ready


def test_loading_a_loaded_model_and_unloading_an_unloaded_one_succeed_at_once(h):
    unload = h.submit("unload", "a")
    assert unload.status is JobStatus.succeeded and "not loaded" in unload.message
    h.submit("load", "a")
    h.finish_load("a")
    again = h.submit("load", "a")
    assert again.status is JobStatus.succeeded and "already loaded" in again.message
    assert len(h.fx.loads) == 1


def test_jobs_on_one_model_run_in_order_and_different_models_together(h):
    h.submit("load", "a")
    second = h.submit("unload", "a")
    other = h.submit("load", "c")
    assert h.job(second.id).status is JobStatus.queued and other.status is JobStatus.running
    h.finish_load("a")
    assert h.job(second.id).status is JobStatus.running  # the unload starts once the load is done
    assert h.fx.stops[-1][:2] == ("a", second.id)


def test_only_a_queued_job_can_be_cancelled(h):
    running, queued = h.submit("load", "a"), h.submit("unload", "a")
    reply = h.loop.create_future()
    h.s.handle(ev.CancelJob(queued.id, reply))
    assert reply.result().status is JobStatus.cancelled and h.job(queued.id).status is JobStatus.cancelled
    reply = h.loop.create_future()
    h.s.handle(ev.CancelJob(running.id, reply))
    assert error_of(reply).status == 409


def test_request_for_unloaded_model_is_refused_with_how_to_load_it(h):
    e = error_of(h.acquire("a"))
    assert e.status == 503 and "'a'" in e.message and "POST /jobs" in e.message
    e = error_of(h.acquire("nope"))
    assert e.status == 404 and "a, b, c" in e.message


def test_request_waits_for_a_running_load_and_autoload_starts_one(h):
    h.submit("load", "a")
    waiting = h.acquire("a")
    assert not waiting.done()
    h.finish_load("a")
    assert waiting.result().replica.model == "a"
    auto = h.acquire("b")
    assert not auto.done() and h.fx.loads[-1][0].trigger is Trigger.autoload
    h.finish_load("b")
    assert auto.result().replica.model == "b"


def test_never_more_requests_than_slots_and_fifo_on_release(h):
    h.submit("load", "a")
    h.finish_load("a", slots=2)
    futures = [h.acquire("a") for _ in range(4)]
    assert [f.done() for f in futures] == [True, True, False, False]
    futures[2].cancel()  # that client left while waiting
    h.s.handle(ev.Release(futures[0].result()))
    assert futures[3].done() and h.s.models["a"].pool.in_flight == 2


def test_queue_bound_answers_429(h):
    h.submit("load", "a")
    h.finish_load("a", slots=1)
    futures = [h.acquire("a") for _ in range(1 + 4)]  # one slot, queue limit 4
    assert all(not f.done() for f in futures[1:])
    assert error_of(h.acquire("a")).status == 429


def test_requests_go_to_the_least_busy_replica():
    h = Harness(profile("m", replicas=2))
    h.submit("load", "m")
    h.finish_load("m", slots=2)
    ports = [h.acquire("m").result().replica.index for _ in range(4)]
    assert sorted(ports[:2]) == [0, 1] and sorted(ports[2:]) == [0, 1]
    h.close()


def test_unload_lets_in_flight_requests_finish_then_stops(h):
    h.submit("load", "a")
    h.finish_load("a")
    lease = h.acquire("a").result()
    unload = h.submit("unload", "a")
    assert h.fx.stops == [] and error_of(h.acquire("a")).status == 503
    h.s.handle(ev.Release(lease))
    assert h.fx.stops[-1][1] == unload.id
    h.now += 1
    h.finish_stop("a")
    assert h.job(unload.id).status is JobStatus.succeeded and h.s.models["a"].status is ModelStatus.unloaded


def test_drain_timeout_cancels_what_still_runs(h):
    h.submit("load", "a")
    h.finish_load("a")
    lease = h.acquire("a").result()
    unload = h.submit("unload", "a")
    delay, timeout = next(t for t in h.fx.timers if isinstance(t[1], ev.DrainTimeout))
    assert delay == 30.0
    h.s.handle(timeout)
    assert h.fx.cancelled[0][0] is lease and h.fx.stops[-1][1] == unload.id
    h.finish_stop("a")
    assert "1 request(s)" in h.job(unload.id).message


def test_failed_load_reports_why_and_refuses_waiters(h):
    job = h.submit("load", "a")
    waiting = h.acquire("a")
    h.s.handle(ev.LoadDone(job.id, "a", error="replica 0 exited with code 1 before it was healthy: boom",
                           log_tail=["boom"]))
    done = h.job(job.id)
    assert done.status is JobStatus.failed and "code 1" in done.error and done.log_tail == ["boom"]
    assert error_of(waiting).status == 503 and h.s.models["a"].status is ModelStatus.unloaded


def test_crashed_replica_restarts_on_failure_up_to_the_limit(h):
    h.submit("load", "c")
    h.finish_load("c", pid0=100)
    h.s.handle(ev.ReplicaExited("c", 100, -9, ""))
    assert h.fx.stops[-1] == ("c", None, h.fx.stops[-1][2])  # the dead replica is cleaned up
    restart = h.fx.loads[-1][0]
    assert restart.trigger is Trigger.restart and h.s.models["c"].status is ModelStatus.loading
    waiting = h.acquire("c")
    h.finish_load("c", pid0=200)
    assert waiting.done() and h.job(restart.id).status is JobStatus.succeeded
    h.s.handle(ev.ReplicaExited("c", 200, 1, "oops"))  # limit 1: no second restart
    assert len(h.fx.loads) == 2 and h.s.models["c"].status is ModelStatus.failed


def test_upstream_failure_mid_stream_marks_the_replica_failed(h):
    h.submit("load", "a")
    h.finish_load("a")
    lease = h.acquire("a").result()
    h.s.handle(ev.Release(lease, failure="the upstream server broke off the response"))
    assert h.s.models["a"].status is ModelStatus.failed and h.fx.stops[-1][2] == [lease.replica]
    assert error_of(h.acquire("a")).status == 503


def test_exclusive_group_unloads_the_other_member_first_as_a_job():
    h = Harness(profile("x", group="g"), profile("y", group="g"), groups={"g": GroupSpec(exclusive=True)})
    h.submit("load", "x")
    h.finish_load("x")
    load_y = h.submit("load", "y")
    unload_x = next(j for j in h.store.list(model="x") if j.type.value == "unload")
    assert unload_x.trigger is Trigger.exclusive and "waiting for x" in h.job(load_y.id).message
    assert [x[1] for x in h.fx.loads] == ["x"]  # y does not start while x runs
    h.finish_stop("x")
    assert [x[1] for x in h.fx.loads] == ["x", "y"]
    h.finish_load("y")
    assert h.job(unload_x.id).status is JobStatus.succeeded and h.job(load_y.id).status is JobStatus.succeeded
    h.close()


def test_idle_ttl_unloads_with_a_recorded_job():
    h = Harness(profile("t", ttl=60))
    h.submit("load", "t")
    h.finish_load("t")
    stale = [e for _, e in h.fx.timers if isinstance(e, ev.IdleCheck)][-1]
    lease = h.acquire("t").result()  # used since: the armed check is stale
    h.s.handle(stale)
    assert not h.store.list(model="t", status=JobStatus.running)
    h.s.handle(ev.Release(lease))
    h.s.handle([e for _, e in h.fx.timers if isinstance(e, ev.IdleCheck)][-1])
    unload = h.store.list(model="t", status=JobStatus.running)[0]
    assert unload.trigger is Trigger.idle_ttl
    h.close()
