"""Helpers for server tests: real `python -m server` processes and SSE parsing (bench.processes).

Servers run on a free port of 127.0.0.1, every wait is bounded, and the process is always killed
when its fixture ends, whatever the test did (see conftest.py)."""
from __future__ import annotations

from bench.processes import LOAD_TIMEOUT, ROOT, ServerProcess, free_port, sse_events

__all__ = ["LOAD_TIMEOUT", "ROOT", "ServerProcess", "free_port", "sse_events"]
