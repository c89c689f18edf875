"""SIGTERM drains: the running stream completes, new requests get 503, the process exits 0."""
from __future__ import annotations

import httpx

from tests.server.helpers import sse_events

BODY = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 600, "ignore_eos": True,
        "stream": True}


def test_sigterm_lets_the_stream_finish_then_exits_0(start_server, tiny_model):
    server = start_server(["-m", str(tiny_model), "-c", "2048", "--drain-timeout", "60"])
    with server.client() as c, c.stream("POST", "/v1/chat/completions", json=BODY) as r:
        events = sse_events(r)
        chunks = [next(events), next(events)]
        server.terminate()
        # Draining: the listening socket stays open and refuses new work with a clear 503.
        late = httpx.post(f"{server.url}/v1/chat/completions", json={**BODY, "stream": False}, timeout=10)
        assert late.status_code == 503 and "shutting down" in late.json()["error"]["message"]
        chunks += list(events)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["timings"]["predicted_n"] == 600
    assert server.proc.wait(timeout=60) == 0, server.log_text()
