"""Real processes on loopback: a proxy (`python -m proxy`) and the tiny-model servers it starts.

Every wait is bounded. A proxy's finalizer kills the proxy and every process below it, and any
server whose command line names the test's model directory, so nothing outlives the tests.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from tests.ports import free_port

REPO = Path(__file__).resolve().parents[2]
TINY_CONFIG = REPO / "configs" / "tiny" / "llama.json"


def alive(pid: int) -> bool:
    """Running, not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def pids_with(text: str) -> list[int]:
    """Live processes whose command line contains `text`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read().replace(b"\0", b" ") and alive(int(entry)):
                        found.append(int(entry))
            except OSError:
                pass
    return found


def wait_until(predicate, timeout: float, what: str, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(interval)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from engine.tiny import write_tiny_model  # the test process may import the engine; the proxy never does
    return write_tiny_model(json.loads(TINY_CONFIG.read_text()), tmp_path_factory.mktemp("tiny") / "llama")


class ProxyProcess:
    """One `python -m proxy` with its own config, state directory and port."""

    def __init__(self, root: Path, profiles: dict, groups: dict | None = None, api_key: str | None = None):
        self.root, self.port = root, free_port()
        (root / "profiles").mkdir(parents=True, exist_ok=True)
        (root / "profiles" / "test.yaml").write_text(yaml.safe_dump(profiles))
        settings = {"port": self.port, "state_dir": str(root / "state"), "groups": groups or {}}
        if api_key:
            settings["api_key"] = api_key
        (root / "proxy.yaml").write_text(yaml.safe_dump(settings))
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.client = httpx.Client(base_url=self.url, timeout=30.0)

    def start(self) -> "ProxyProcess":
        self.log = open(self.root / f"proxy-{time.monotonic_ns()}.log", "w")
        self.proc = subprocess.Popen([sys.executable, "-m", "proxy", "--config", str(self.root / "proxy.yaml")],
                                     cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)

        def up():
            assert self.proc.poll() is None, f"proxy exited: {(self.root / self.log.name).read_text()}"
            try:
                return httpx.get(self.url + "/health", timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(up, 20, "the proxy's /health")
        return self

    def descendants(self) -> list[int]:
        parents: dict[int, int] = {}
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    with open(f"/proc/{entry}/stat") as f:
                        parents[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
                except (OSError, IndexError, ValueError):
                    pass
        found, frontier = [], [self.proc.pid] if self.proc else []
        while frontier:
            kids = [p for p, pp in parents.items() if pp in frontier]
            found += kids
            frontier = kids
        return found

    def kill_all(self) -> None:
        pids = self.descendants() + pids_with(str(self.root))
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    # -- API helpers --------------------------------------------------------------------------

    def job(self, type_: str, model: str, timeout: float = 90) -> dict:
        """Submits a job and waits for it to finish."""
        r = self.client.post("/jobs", json={"type": type_, "model": model})
        assert r.status_code == 202, r.text
        return self.wait_job(r.json()["id"], timeout)

    def wait_job(self, job_id: str, timeout: float = 90) -> dict:
        def finished():
            job = self.client.get(f"/jobs/{job_id}").json()
            return job if job["status"] in ("succeeded", "failed", "cancelled") else None
        return wait_until(finished, timeout, f"job {job_id}", interval=0.1)

    def replicas(self, model: str) -> list[dict]:
        models = {m["model"]: m for m in self.client.get("/running").json()["models"]}
        return models[model]["replicas"] if model in models else []


@pytest.fixture(scope="module")
def make_proxy(tmp_path_factory):
    """Starts proxies for one test module; all are killed (with their servers) at its end."""
    started: list[ProxyProcess] = []

    def make(profiles: dict, **kw) -> ProxyProcess:
        p = ProxyProcess(tmp_path_factory.mktemp("proxy"), profiles, **kw)
        started.append(p)
        return p.start()
    yield make
    for p in started:
        p.kill_all()


# A stream that must still be running while a test acts on it: the tiny model decodes about 1,700
# tokens/s, so a few seconds take most of its trained context (4,096 positions, each slot's size).
LONG_STREAM = 4000


def tiny_profile(model: Path, parallel: int = 2, **extra) -> dict:
    return {"args": ["-m", str(model), "-c", str(4096 * parallel), "-np", str(parallel), "-t", "1"],
            "health_timeout": 90, "drain_timeout": 30, "stop_grace": 5, **extra}


def sse_events(lines) -> list[dict | str]:
    """Parsed `data:` payloads of an SSE body ('[DONE]' kept as a string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
