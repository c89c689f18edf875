"""Real processes on loopback: a proxy (`python -m proxy`) and the tiny-model servers it starts.

Every wait is bounded. A proxy's finalizer kills the proxy and every process below it, and any
server whose command line names the test's model directory, so nothing outlives the tests.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bench.processes import ProxyProcess

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
# Its servers send a chunk per step (`--stream-interval-ms 0`): at the default's chunk per 20 ms the
# tiny model outruns that pace, and a relayed stream's chunks would depend on timing.
LONG_STREAM = 4000


def tiny_profile(model: Path, parallel: int = 2, **extra) -> dict:
    return {"args": ["-m", str(model), "-c", str(4096 * parallel), "-np", str(parallel), "-t", "1",
                     "--stream-interval-ms", "0"],
            "health_timeout": 90, "drain_timeout": 30, "stop_grace": 5, **extra}


FAKE_SERVER = str(Path(__file__).with_name("fake_server.py"))


def fake_profile(mode: str, env: dict | None = None, **extra) -> dict:
    """A profile whose server is fake_server.py in `mode` (FAKE_SERVER), with more `env` if given."""
    return {"args": ["-m", "fake", "-np", "1"], "command": [sys.executable, FAKE_SERVER],
            "env": {"FAKE_SERVER": mode, **(env or {})}, "health_timeout": 30, "stop_grace": 2, **extra}


def sse_events(lines) -> list[dict | str]:
    """Parsed `data:` payloads of an SSE body ('[DONE]' kept as a string)."""
    out = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[6:]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out
