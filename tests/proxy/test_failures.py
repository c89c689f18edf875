"""When servers fail: a server that cannot start, one killed mid-stream, and exclusive swaps."""
from __future__ import annotations

import os
import signal

import httpx
import pytest

from bench.processes import alive, pids_with, wait_until
from tests.proxy.conftest import LONG_STREAM, sse_events, tiny_profile


@pytest.fixture(scope="module")
def proxy(make_proxy, tiny_model, tmp_path_factory):
    missing = tmp_path_factory.mktemp("missing") / "no-such-model"
    return make_proxy({
        "broken": tiny_profile(missing),
        "crashy": tiny_profile(tiny_model, restart="on-failure", restart_limit=2),
        "x": tiny_profile(tiny_model, parallel=1, group="pair", drain_timeout=1),
        "y": tiny_profile(tiny_model, parallel=1, group="pair"),
        "z": tiny_profile(missing, parallel=1, group="pair"),  # a member whose load fails
    }, groups={"pair": {"exclusive": True}})


def test_server_that_fails_to_start_gives_a_failed_job_with_its_reason_and_no_leftover(proxy):
    job = proxy.job("load", "broken")
    assert job["status"] == "failed" and job["duration_s"] is not None
    assert "replica 0 exited with code" in job["error"] and "no-such-model" in job["error"], job["error"]
    assert job["log_tail"] and any("no-such-model" in line for line in job["log_tail"])
    assert proxy.replicas("broken") == [] and pids_with("--alias broken") == []
    r = proxy.client.post("/v1/completions", json={"model": "broken", "prompt": "x"})
    assert r.status_code == 503 and "exited with code" in r.json()["error"]["message"]


def test_upstream_killed_mid_stream_ends_the_stream_with_an_error_and_restarts(proxy):
    assert proxy.job("load", "crashy")["status"] == "succeeded"
    [before] = proxy.replicas("crashy")
    body = {"model": "crashy", "prompt": "x", "max_tokens": LONG_STREAM, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        wait_until(lambda: next(lines).startswith("data: "), 30, "the first event")
        os.kill(before["pid"], signal.SIGKILL)
        events = sse_events(lines)
    assert events[-1] == "[DONE]" and "upstream" in events[-2]["error"]["message"], events[-2:]
    restarted = wait_until(lambda: [r for r in proxy.replicas("crashy") if r["state"] == "ready"], 90,
                           "the replica to come back")
    assert restarted[0]["pid"] != before["pid"]
    restart_job = proxy.client.get("/jobs", params={"model": "crashy"}).json()[0]
    assert (restart_job["trigger"], restart_job["status"]) == ("restart", "succeeded")
    assert "restart 1/2" in restart_job["message"]
    # ignore_eos: the request samples (no temperature given), and a random tiny model may pick EOS.
    r = proxy.client.post("/v1/completions",
                          json={"model": "crashy", "prompt": "x", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_exclusive_group_swaps_models_with_recorded_jobs(proxy):
    """Loading y unloads x first; x's stream outlasts x's 1 s drain timeout and is cut off with a reason."""
    assert proxy.job("load", "x")["status"] == "succeeded"
    [x] = proxy.replicas("x")
    body = {"model": "x", "prompt": "x", "max_tokens": LONG_STREAM, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        wait_until(lambda: next(lines).startswith("data: "), 30, "the first event")
        load_y = proxy.client.post("/jobs", json={"type": "load", "model": "y"}).json()
        events = sse_events(lines)
    assert events[-1] == "[DONE]" and "drain timeout" in events[-2]["error"]["message"], events[-2:]
    load_y = proxy.wait_job(load_y["id"])
    assert load_y["status"] == "succeeded"
    unload_x = proxy.client.get("/jobs", params={"model": "x", "limit": 1}).json()[0]
    assert (unload_x["type"], unload_x["trigger"], unload_x["status"]) == ("unload", "exclusive", "succeeded")
    assert "making way for 'y'" in unload_x["message"] and "1 request(s)" in unload_x["message"]
    assert unload_x["finished_at"] <= load_y["finished_at"]
    assert not alive(x["pid"]) and proxy.replicas("x") == [] and len(proxy.replicas("y")) == 1
    statuses = {m["model"]: m["status"] for m in proxy.client.get("/running").json()["models"]}
    assert statuses.get("y") == "ready" and "x" not in statuses


def restored(proxy, model: str) -> dict:
    """The restore job that loads `model` back, once it has succeeded; and `model` serves."""
    def done():
        jobs = [j for j in proxy.client.get("/jobs", params={"model": model}).json() if j["trigger"] == "restore"]
        return jobs[0] if jobs and jobs[0]["status"] == "succeeded" else None
    job = wait_until(done, 90, f"{model} to be loaded back")
    r = proxy.client.post("/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return job


def test_a_swap_cancelled_mid_load_loads_back_the_model_it_displaced(proxy):
    if not proxy.replicas("x"):
        assert proxy.job("load", "x")["status"] == "succeeded"
    load_y = proxy.client.post("/jobs", json={"type": "load", "model": "y"}).json()
    wait_until(lambda: not proxy.replicas("x"), 60, "x to make way for y")
    cancelled = proxy.client.delete(f"/jobs/{load_y['id']}")
    assert cancelled.status_code == 200 and "loading back what it unloaded: x" in cancelled.json()["message"]
    job = restored(proxy, "x")
    assert f"the load of 'y' that unloaded it was cancelled (job {load_y['id']})" in job["message"]


def test_a_swap_whose_load_fails_loads_back_the_model_it_displaced(proxy):
    if not proxy.replicas("x"):
        assert proxy.job("load", "x")["status"] == "succeeded"
    failed = proxy.job("load", "z")
    assert failed["status"] == "failed" and "loading back what it unloaded: x" in failed["message"]
    restored(proxy, "x")
