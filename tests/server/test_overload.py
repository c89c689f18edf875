"""Overload: a bounded wait queue (--queue-limit: 503 with Retry-After beyond it) and a time limit
per request (--timeout: the request ends with finish_reason "timeout")."""
from __future__ import annotations

import threading
import time

import httpx

from tests.server.helpers import sse_events, wait_idle

LONG = {"prompt": "abc", "max_tokens": 30000, "ignore_eos": True}  # fits the servers' -c 32768


def hold_streams(server, n: int, stop: threading.Event) -> list[threading.Thread]:
    """n streams that run until `stop` is set; returns once the server counts them all."""
    def stream():
        with server.client() as c, c.stream("POST", "/v1/completions", json={**LONG, "stream": True}) as r:
            for _ in sse_events(r):
                if stop.is_set():
                    break

    threads = [threading.Thread(target=stream) for _ in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while f"tandem:requests_deferred {n - 1}\n" not in httpx.get(f"{server.url}/metrics").text:
        assert time.monotonic() < deadline, "the streams did not start"
        time.sleep(0.05)
    return threads


def test_a_request_beyond_the_queue_limit_gets_503_with_retry_after(start_server, tiny_model):
    server = start_server(["-m", str(tiny_model), "-c", "32768", "-np", "1", "--queue-limit", "1"])
    stop = threading.Event()
    threads = hold_streams(server, 2, stop)  # one in the slot, one waiting: the queue is full
    try:
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "abc", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and r.headers["Retry-After"] == "1"
        error = r.json()["error"]
        assert error["type"] == "unavailable_error" and "--queue-limit" in error["message"]
        assert "1 request(s) already wait" in error["message"]
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "abc", "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text


def test_a_request_past_the_time_limit_ends_with_finish_reason_timeout(start_server, tiny_model):
    server = start_server(["-m", str(tiny_model), "-c", "32768", "-np", "1", "--timeout", "1.5"])
    with server.client() as c:
        t0 = time.monotonic()
        whole = c.post("/v1/completions", json=LONG).json()
        assert 1.5 <= time.monotonic() - t0 < 10
        choice = whole["choices"][0]
        assert choice["finish_reason"] == "timeout" and choice["text"]
        assert 0 < whole["usage"]["completion_tokens"] < 30000
        with c.stream("POST", "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": LONG["max_tokens"], "ignore_eos": True,
                                                             "stream": True}) as r:
            chunks = list(sse_events(r))
        assert chunks[-1]["choices"][0]["finish_reason"] == "timeout" and chunks[-1]["timings"]["predicted_n"] > 0
        wait_idle(c)  # the engine request was cancelled
        assert c.post("/v1/completions", json={"prompt": "abc", "max_tokens": 2}).json()["choices"][0][
            "finish_reason"] == "length"
