"""Helpers for server tests: real `python -m server` processes and SSE parsing (from bench.processes),
and waiting for a server's slots to go idle.

Servers run on a free port of 127.0.0.1, every wait is bounded, and the process is always killed
when its fixture ends, whatever the test did (see conftest.py)."""
from __future__ import annotations

import time

import httpx

from bench.processes import LOAD_TIMEOUT, ROOT, ServerProcess, free_port, sse_events

__all__ = ["LOAD_TIMEOUT", "ROOT", "ServerProcess", "free_port", "sse_events", "wait_idle"]


def wait_idle(client: httpx.Client, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        slots = client.get("/slots").json()
        if not any(s["is_processing"] for s in slots):
            return slots
        time.sleep(0.05)
    raise AssertionError(f"slots still busy after {timeout} s: {slots}")
