"""Real `python -m server` and `python -m proxy` processes on a free loopback port, for benchmarks
and tests: every wait is bounded, and each process is killed when its owner is done with it."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from engine.pipeline.ports import free_port
from engine.threads import stat_fields


ROOT = Path(__file__).resolve().parents[1]
LOAD_TIMEOUT = 180.0  # the default model loads in ~12 s on an idle machine; colleagues share it


def wait_answering(proc: subprocess.Popen, url: str, log_text, timeout: float = LOAD_TIMEOUT) -> None:
    """Until GET url answers 200. Raises, with the tail of the process's log (log_text()), when the
    process exits first or the time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log_text()}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server not ready after {timeout} s:\n{log_text()}")


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, api_key: str | None = None, env: dict | None = None,
                 threads: int | None = 1):
        """env: variables added to this process's environment; threads: -t (one by default, as tests
        share the machine; None: the server's own default, as the main command runs)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        cmd = [sys.executable, "-m", "server", "--port", str(self.port), *(["-t", str(threads)] if threads else []),
               *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = LOAD_TIMEOUT) -> "ServerProcess":
        wait_answering(self.proc, f"{self.url}/health", self.log_text, timeout)
        return self

    def client(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=kwargs.pop("timeout", 120), **kwargs)

    def log_text(self) -> str:
        self.log.flush()
        return self.log_path.read_text()[-4000:]

    def terminate(self) -> None:
        self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)
        self.log.close()


class BusyLoops:
    """`with BusyLoops(n):` n processes that spin at nice 19 meanwhile, as a build or another user's
    job would beside a server: a host that is not the server's alone."""

    def __init__(self, n: int, cpus: set[int] | None = None):
        """cpus: the CPUs they run on (None: any)."""
        self.n, self.cpus, self.procs = n, cpus, []

    def _setup(self) -> None:
        os.nice(19)
        if self.cpus is not None:
            os.sched_setaffinity(0, self.cpus)

    def start(self) -> None:
        # A session of their own, as another user's job has: where the kernel groups processes by
        # session (autogroup), nice 19 counts only within the group, and the loops get a fair share.
        self.procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=self._setup,
                                       start_new_session=True) for _ in range(self.n)]

    def stop(self) -> None:
        for p in self.procs:
            p.kill()
            p.wait(timeout=30)
        self.procs = []

    def __enter__(self) -> "BusyLoops":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def sse_events(response: httpx.Response):
    """The JSON payloads of an SSE response, up to (not including) `[DONE]`."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return
        yield json.loads(data)


def alive(pid: int) -> bool:
    """Running, not a zombie."""
    fields = stat_fields(pid)
    return fields is not None and fields[0] != "Z"


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


def descendants(pid: int) -> list[int]:
    """The processes started by `pid`, and by them, and so on."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := stat_fields(entry)) is not None:
            parents[int(entry)] = int(fields[1])
    found, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parents.items() if pp in frontier]
        found += kids
        frontier = kids
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
                                     cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        wait_answering(self.proc, self.url + "/health", lambda: Path(self.log.name).read_text(), 20)
        return self

    def descendants(self) -> list[int]:
        return descendants(self.proc.pid) if self.proc else []

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
