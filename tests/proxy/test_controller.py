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


def test_a_queued_job_can_be_cancelled_and_a_running_unload_or_a_finished_job_cannot(h):
    running, queued = h.submit("load", "a"), h.submit("unload", "a")
    reply = h.cancel(queued.id)
    assert reply.result().status is JobStatus.cancelled and h.job(queued.id).status is JobStatus.cancelled
    h.finish_load("a")
    e = error_of(h.cancel(running.id))
    assert e.status == 409 and "succeeded" in e.message
    unload = h.submit("unload", "a")
    lease = h.acquire("a")  # refused: the unload runs; the model is not autoload
    e = error_of(h.cancel(unload.id))
    assert e.status == 409 and "running unload, which cannot be undone" in e.message
    assert error_of(lease).status == 503 and h.job(unload.id).status is JobStatus.running


def test_cancelling_a_running_load_stops_its_servers_and_leaves_the_model_unloaded(h):
    job = h.submit("load", "a")
    h.s.handle(ev.ReplicaStarting(job.id, "a", 0, 9000, 100))
    waiting = h.acquire("a")
    reply = h.cancel(job.id)
    assert h.fx.load_cancels == [job.id] and not reply.done()  # answered once the server is stopped
    assert h.job(job.id).status is JobStatus.running and "cancelling" in h.job(job.id).message
    again = h.cancel(job.id)  # a second DELETE waits for the same end
    assert h.fx.load_cancels == [job.id]
    h.s.handle(ev.LoadCancelled(job.id, "a", [100], ["loading weights"]))
    done = h.job(job.id)
    assert reply.result().status is JobStatus.cancelled and again.result().status is JobStatus.cancelled
    assert done.status is JobStatus.cancelled and "pid 100" in done.message and done.error is None
    assert done.log_tail == ["loading weights"]
    m = h.s.models["a"]
    assert m.status is ModelStatus.unloaded and m.pool.replicas == [] and h.s.running() == []
    e = error_of(waiting)
    assert e.status == 503 and f"load job {job.id} was cancelled" in e.message
    h.submit("load", "a")  # a later load works
    h.finish_load("a")
    assert m.status is ModelStatus.ready and h.acquire("a").result().replica.model == "a"


def test_a_load_that_ends_before_the_cancel_reaches_it_keeps_its_outcome(h):
    job = h.submit("load", "a")
    reply = h.cancel(job.id)
    h.finish_load("a")  # its LoadDone was already on its way
    e = error_of(reply)
    assert e.status == 409 and "succeeded before it could be cancelled" in e.message
    assert h.job(job.id).status is JobStatus.succeeded and h.s.models["a"].status is ModelStatus.ready


def test_a_starting_replica_is_listed_with_its_pid_until_its_load_ends(h):
    job = h.submit("load", "a")
    h.s.handle(ev.ReplicaStarting(job.id, "a", 0, 9000, 100))
    h.s.handle(ev.ReplicaStarting("0" * 32, "a", 1, 9001, 101))  # of no running job: ignored
    [running] = h.s.running()
    assert running["status"] == "loading" and running["current_job"] == job.id
    assert [(r["state"], r["pid"], r["port"]) for r in running["replicas"]] == [("starting", 100, 9000)]
    assert h.acquire("a").done() is False  # a starting replica takes no request
    h.finish_load("a", ports=(9000,), pid0=100)
    assert [(r["state"], r["pid"]) for r in h.s.running()[0]["replicas"]] == [("ready", 100)]


def test_a_failed_load_forgets_its_starting_replicas(h):
    job = h.submit("load", "a")
    h.s.handle(ev.ReplicaStarting(job.id, "a", 0, 9000, 100))
    h.s.handle(ev.LoadDone(job.id, "a", error="replica 0 was killed by signal 9 (SIGKILL) before it was healthy"))
    assert h.s.models["a"].pool.replicas == [] and h.s.running() == []


def test_a_replica_killed_by_a_signal_is_reported_by_the_signal_without_its_last_line(h):
    h.submit("load", "c")
    h.finish_load("c", pid0=100)
    h.s.handle(ev.ReplicaExited("c", 100, -9, "INFO slot 0: decoding"))
    reason = "replica 0 (pid 100) was killed by signal 9 (SIGKILL)"
    assert reason in h.fx.loads[-1][0].message and "decoding" not in h.fx.loads[-1][0].message
    h.finish_load("c", pid0=200)
    h.s.handle(ev.ReplicaExited("c", 200, 1, "ValueError: bad weights"))  # an exit code keeps the line that says why
    assert h.s.models["c"].last_error == "replica 0 (pid 200) exited with code 1: ValueError: bad weights"


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
    assert delay == 60.0  # the profile's default, as the server's --drain-timeout
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


@pytest.fixture
def swap():
    """Two autoload members of an exclusive group, x loaded."""
    harness = Harness(profile("x", group="g", autoload=True), profile("y", group="g", autoload=True),
                      groups={"g": GroupSpec(exclusive=True)})
    harness.submit("load", "x")
    harness.finish_load("x")
    yield harness
    harness.close()


def test_autoload_request_for_a_member_being_unloaded_waits_for_it_to_load_again(swap):
    """As llama-swap does: the request for x that arrives while y's load unloads x is queued, and x
    loads back once y has served its own waiter."""
    h = swap
    x_lease = h.acquire("x").result()  # keeps x unloading for a while
    for_y = h.acquire("y")
    assert h.s.models["x"].status is ModelStatus.unloading
    for_x = h.acquire("x")
    assert not for_x.done()  # today's answer was 503 "is being unloaded"
    reload_x = h.store.list(model="x")[0]
    assert (reload_x.type.value, reload_x.trigger, reload_x.status) == ("load", Trigger.autoload, JobStatus.queued)
    h.s.handle(ev.Release(x_lease))
    h.finish_stop("x")
    assert [x[1] for x in h.fx.loads] == ["x", "y"]  # y, whose load waited for the unload, goes first
    h.finish_load("y")
    y_lease = for_y.result()
    assert not for_x.done() and h.s.models["y"].status is ModelStatus.unloading
    h.s.handle(ev.Release(y_lease))
    h.finish_stop("y")
    assert [x[1] for x in h.fx.loads] == ["x", "y", "x"]
    h.finish_load("x", pid0=300)
    assert for_x.result().replica.pid == 300 and h.job(reload_x.id).status is JobStatus.succeeded


def test_autoload_request_waiting_through_an_unload_gets_the_reloads_error(swap):
    h = swap
    h.submit("unload", "x")
    lease = h.acquire("x")
    assert not lease.done()
    h.finish_stop("x")
    job, name, _ = h.fx.loads[-1]
    assert name == "x" and job.trigger is Trigger.autoload
    h.s.handle(ev.LoadDone(job.id, "x", error="replica 0 exited with code 1 before it was healthy: no memory"))
    e = error_of(lease)
    assert e.status == 503 and "no memory" in e.message


def test_requests_queued_when_an_autoload_model_starts_unloading_load_it_again(swap):
    h = swap
    busy = [h.acquire("x") for _ in range(3)]  # two slots: the third waits
    assert [f.done() for f in busy] == [True, True, False]
    unload = h.submit("unload", "x")
    reload_x = h.store.list(model="x")[0]
    assert reload_x.trigger is Trigger.autoload and "waited for it while it unloaded" in reload_x.message
    for f in busy[:2]:
        h.s.handle(ev.Release(f.result()))
    h.finish_stop("x")
    assert h.job(unload.id).status is JobStatus.succeeded and not busy[2].done()
    h.finish_load("x", pid0=400)
    assert busy[2].result().replica.pid == 400


def test_a_load_waiting_for_its_group_is_cancelled_at_once(swap):
    h = swap
    x_lease = h.acquire("x").result()
    load_y = h.submit("load", "y")
    reply = h.cancel(load_y.id)
    assert reply.result().status is JobStatus.cancelled and "exclusive group" in reply.result().message
    assert h.fx.load_cancels == [] and [x[1] for x in h.fx.loads] == ["x"]
    h.s.handle(ev.Release(x_lease))  # the unload it asked for still runs to its end, then x loads back
    h.finish_stop("x")
    assert [x[1] for x in h.fx.loads] == ["x", "x"] and h.store.list(model="x")[0].trigger is Trigger.restore
    h.finish_load("x")
    assert h.s.models["x"].status is ModelStatus.ready


@pytest.mark.parametrize("how", ["cancelled", "failed"])
def test_a_swap_that_is_cancelled_or_fails_loads_back_what_it_unloaded(swap, how):
    h = swap
    load_y = h.submit("load", "y")
    h.finish_stop("x")  # x made way for y, which starts loading
    assert [x[1] for x in h.fx.loads] == ["x", "y"] and h.s.models["x"].status is ModelStatus.unloaded
    if how == "cancelled":
        h.cancel(load_y.id)
        h.s.handle(ev.LoadCancelled(load_y.id, "y", [101]))
    else:
        h.s.handle(ev.LoadDone(load_y.id, "y", error="replica 0 exited with code 1 before it was healthy: no memory"))
    assert h.job(load_y.id).status.value == how and "loading back what it unloaded: x" in h.job(load_y.id).message
    restore = h.store.list(model="x")[0]
    assert (restore.type.value, restore.trigger, restore.status) == ("load", Trigger.restore, JobStatus.running)
    assert f"was {how} (job {load_y.id})" in restore.message
    assert [x[1] for x in h.fx.loads] == ["x", "y", "x"]
    h.finish_load("x")
    assert h.s.models["x"].status is ModelStatus.ready and h.job(restore.id).status is JobStatus.succeeded


def test_a_swap_that_succeeds_loads_nothing_back(swap):
    h = swap
    load_y = h.submit("load", "y")
    h.finish_stop("x")
    h.finish_load("y")
    assert h.job(load_y.id).status is JobStatus.succeeded and [x[1] for x in h.fx.loads] == ["x", "y"]
    assert not any(j.trigger is Trigger.restore for j in h.store.list(model="x"))


def test_a_drain_refuses_the_waiting_requests_as_new_ones_and_its_unload_loads_nothing(h):
    h.submit("load", "b")
    h.finish_load("b", slots=1)
    running, waiting = h.acquire("b"), h.acquire("b")
    assert running.done() and not waiting.done()
    h.s.begin_drain()
    refused, late = error_of(waiting), error_of(h.acquire("b"))
    for e in (refused, late):
        assert e.status == 503 and e.headers == {"Retry-After": "5"} and "shutting down" in e.message
    loads = len(h.fx.loads)
    unload = h.submit("unload", "b", Trigger.shutdown)
    assert unload.status is JobStatus.running and len(h.fx.loads) == loads  # b is autoload: no reload queued
