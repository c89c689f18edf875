"""Loads seen from outside: a load in progress in /running, cancelling it with nothing left running,
a server killed by a signal while it starts, and an exclusive group's autoload members swapping back.
The servers are tests/proxy/fake_server.py: they start at once, or misbehave on purpose."""
from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from bench.processes import alive, pids_with, wait_until
from tests.proxy.conftest import FAKE_SERVER, fake_profile


@pytest.fixture(scope="module")
def proxy(make_proxy):
    return make_proxy({"slow": fake_profile("slow"), "killed": fake_profile("killed"),
                       "p": fake_profile("serve", group="swap", autoload=True),
                       "q": fake_profile("serve", group="swap", autoload=True)},
                      groups={"swap": {"exclusive": True}})


def statuses(proxy) -> dict[str, str]:
    return {m["model"]: m["status"] for m in proxy.client.get("/running").json()["models"]}


def start_slow_load(proxy) -> tuple[dict, dict]:
    """A load of the never-healthy server, once its process runs: (the job, its replica in /running)."""
    job = proxy.client.post("/jobs", json={"type": "load", "model": "slow"}).json()
    [replica] = wait_until(lambda: proxy.replicas("slow"), 15, "the starting replica in /running")
    return job, replica


def test_running_lists_a_starting_replica_with_its_pid(proxy):
    job, replica = start_slow_load(proxy)
    assert (replica["state"], replica["index"], replica["slots_busy"]) == ("starting", 0, 0)
    assert alive(replica["pid"]) and replica["pid"] in proxy.descendants()
    [model] = [m for m in proxy.client.get("/running").json()["models"] if m["model"] == "slow"]
    assert (model["status"], model["current_job"]) == ("loading", job["id"])
    assert proxy.client.delete(f"/jobs/{job['id']}").json()["status"] == "cancelled"


def test_cancelling_a_running_load_stops_its_server_and_leaves_the_model_unloaded(proxy):
    job, replica = start_slow_load(proxy)
    started = wait_until(lambda: d if len(d := proxy.descendants()) >= 2 else None, 15, "the server and its helper")
    assert replica["pid"] in started
    r = proxy.client.delete(f"/jobs/{job['id']}")
    assert r.status_code == 200, r.text
    cancelled = r.json()
    assert cancelled["status"] == "cancelled" and f"pid {replica['pid']}" in cancelled["message"]
    assert cancelled["error"] is None and cancelled["duration_s"] is not None
    assert proxy.client.get(f"/jobs/{job['id']}").json()["status"] == "cancelled"
    # DELETE answers once the server is stopped; its helper (same process group) goes with it
    wait_until(lambda: not [pid for pid in started if alive(pid)], 2, "no process of the load left")
    assert proxy.descendants() == [] and pids_with(FAKE_SERVER) == []
    assert "slow" not in statuses(proxy)
    assert proxy.client.delete(f"/jobs/{job['id']}").status_code == 409
    again, _ = start_slow_load(proxy)  # the model's state is consistent: a later load starts
    assert again["status"] == "running"
    assert proxy.client.delete(f"/jobs/{again['id']}").json()["status"] == "cancelled"


def test_a_server_killed_by_a_signal_is_reported_by_the_signal_with_its_log_tail_apart(proxy):
    job = proxy.job("load", "killed", timeout=30)
    assert job["status"] == "failed"
    assert job["error"] == "replica 0 was killed by signal 9 (SIGKILL) before it was healthy", job["error"]
    assert job["log_tail"] == ["INFO fake server (killed) loading"]


def test_autoload_request_for_a_group_member_being_unloaded_is_served_after_it_loads_again(proxy):
    """A request for q unloads p (exclusive group), which drains its one long request; a request for
    p meanwhile waits (it used to get 503) and is served once q has served its own and made way."""
    assert proxy.job("load", "p")["status"] == "succeeded"

    def complete(model: str, sleep: float = 0) -> httpx.Response:
        return httpx.post(proxy.url + "/v1/completions", json={"model": model, "prompt": "x", "sleep": sleep},
                          timeout=30)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        long = pool.submit(complete, "p", 3)
        wait_until(lambda: proxy.replicas("p")[0]["slots_busy"] == 1, 10, "p's long request")
        for_q = pool.submit(complete, "q")
        wait_until(lambda: statuses(proxy).get("p") == "unloading", 10, "p to start unloading")
        for_p = pool.submit(complete, "p")
        reload_p = wait_until(lambda: [j for j in proxy.client.get("/jobs", params={"model": "p"}).json()
                                       if j["trigger"] == "autoload"], 10, "p's autoload job")[0]
        unload_p = proxy.client.get("/jobs", params={"model": "p"}).json()[1]
        assert (unload_p["type"], unload_p["trigger"], unload_p["status"]) == ("unload", "exclusive", "running")
        answers = [f.result() for f in (long, for_q, for_p)]
    assert [a.status_code for a in answers] == [200, 200, 200], [a.text for a in answers]
    assert [a.json()["model"] for a in answers] == ["p", "q", "p"]
    reload_p = proxy.wait_job(reload_p["id"], 10)
    load_q, unload_q = sorted(proxy.client.get("/jobs", params={"model": "q"}).json(), key=lambda j: j["created_at"])
    assert reload_p["status"] == "succeeded" and load_q["status"] == "succeeded"
    assert (unload_q["type"], unload_q["trigger"], unload_q["status"]) == ("unload", "exclusive", "succeeded")
    assert load_q["finished_at"] <= unload_q["finished_at"] <= reload_p["finished_at"]  # q was served first
    assert statuses(proxy) == {"p": "ready"}
