"""The proxy's own endpoints with servers that never get healthy: API key, job queue, cancel,
health timeout, config reload."""
from __future__ import annotations

import sys

import httpx
import pytest
import yaml

from bench.processes import pids_with, wait_until

KEY = "sekrit"


@pytest.fixture(scope="module")
def proxy(make_proxy, tmp_path_factory):
    script = tmp_path_factory.mktemp("never") / "never_healthy.py"
    script.write_text("import time; time.sleep(120)\n")
    p = make_proxy({"slow": {"args": ["-m", "x"], "command": [sys.executable, str(script)], "health_timeout": 2,
                             "stop_grace": 1}}, api_key=KEY)
    p.client.headers["authorization"] = f"Bearer {KEY}"
    p.script = str(script)
    return p


def test_api_key_is_required_everywhere_but_health(proxy):
    assert httpx.get(proxy.url + "/health").status_code == 200
    r = httpx.get(proxy.url + "/jobs")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.post(proxy.url + "/v1/completions", json={"model": "slow", "prompt": "x"}).status_code == 401
    assert proxy.client.get("/jobs").status_code == 200


def test_jobs_queue_per_model_cancel_and_health_timeout(proxy):
    load = proxy.client.post("/jobs", json={"type": "load", "model": "slow"}).json()
    unload = proxy.client.post("/jobs", json={"type": "unload", "model": "slow"}).json()
    assert (load["status"], unload["status"]) == ("running", "queued")
    cancelled = proxy.client.delete(f"/jobs/{unload['id']}").json()
    assert cancelled["status"] == "cancelled"
    assert [j["id"] for j in proxy.client.get("/jobs", params={"model": "slow"}).json()] == [unload["id"], load["id"]]
    assert proxy.client.get("/jobs", params={"status": "cancelled"}).json()[0]["id"] == unload["id"]
    failed = proxy.wait_job(load["id"], 30)
    assert failed["status"] == "failed" and "did not answer /health with 200 within 2 s" in failed["error"]
    assert proxy.client.delete(f"/jobs/{load['id']}").status_code == 409  # finished: nothing to cancel
    wait_until(lambda: not pids_with(proxy.script), 5, "the never-healthy server to be stopped")
    assert proxy.client.get(f"/jobs/{load['id']}/log").status_code == 200


def test_bad_requests_name_the_problem(proxy):
    r = proxy.client.post("/jobs", json={"type": "reload", "model": "slow"})
    assert r.status_code == 400 and "type" in r.json()["error"]["message"]
    r = proxy.client.post("/jobs", json={"type": "load", "model": "nope"})
    assert r.status_code == 404 and "slow" in r.json()["error"]["message"]
    assert proxy.client.get("/jobs/" + "0" * 32).status_code == 404
    r = proxy.client.post("/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_reload_refuses_a_bad_config_whole_and_applies_a_good_one(proxy):
    path = proxy.root / "profiles" / "test.yaml"
    good = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**good, "bad1": {"args": []}, "bad2": {"args": ["-m", "x"], "ttl": "soon"}}))
    r = proxy.client.post("/config/reload")
    message = r.json()["error"]["message"]
    assert r.status_code == 400 and "'bad1': args" in message and "'bad2': ttl" in message
    path.write_text(yaml.safe_dump({**good, "extra": {"args": ["-m", "y"]}}))
    assert proxy.client.post("/config/reload").json() == {"profiles": ["extra", "slow"]}
    ids = [m["id"] for m in proxy.client.get("/v1/models").json()["data"]]
    assert ids == ["extra", "slow"]
