"""Helpers for server tests: real `python -m server` processes and SSE parsing.

Servers run on a free port of 127.0.0.1, every wait is bounded, and the process is always killed
when its fixture ends, whatever the test did (see conftest.py)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from tests.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
LOAD_TIMEOUT = 180.0  # the default model loads in ~12 s on an idle machine; colleagues share it


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, api_key: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        cmd = [sys.executable, "-m", "server", "--port", str(self.port), "-t", "1", *args]
        if api_key:
            cmd += ["--api-key", api_key]
        self.log = open(log_path, "w")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = LOAD_TIMEOUT) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_text()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log_text()}")

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


def sse_events(response: httpx.Response):
    """The JSON payloads of an SSE response, up to (not including) `[DONE]`."""
    for line in response.iter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            return
        yield json.loads(data)


def wait_idle(client: httpx.Client, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        slots = client.get("/slots").json()
        if not any(s["is_processing"] for s in slots):
            return slots
        time.sleep(0.05)
    raise AssertionError(f"slots still busy after {timeout} s: {slots}")
