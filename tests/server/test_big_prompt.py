"""A prompt of megabytes costs its own request, not everyone's: it is refused from its size before
it is tokenized, a long prompt that may fit is tokenized off the event loop, and the memory a big
body took is given back."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.helpers import sse_events

MAX_GAP_S = 0.5


@pytest.fixture(scope="module")
def server(start_server, tiny_model):
    # 65536 positions a slot: the tiny tokenizer's longest token spells 13 bytes, so text up to
    # 852 kB may fit and is tokenized; beyond that it cannot.
    s = start_server(["-m", str(tiny_model), "-c", "131072", "-np", "2"])
    yield s
    s.kill()


def rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1])


def largest_gap_during(server, request) -> tuple[float, httpx.Response]:
    """Runs `request()` while a stream generates; the stream's largest gap between chunks
    while the request was under way."""
    arrivals: list[float] = []
    started, done = threading.Event(), threading.Event()

    def stream():
        body = {"prompt": "abc", "max_tokens": 60000, "ignore_eos": True, "stream": True}
        with server.client() as c, c.stream("POST", "/v1/completions", json=body) as r:
            for _ in sse_events(r):
                arrivals.append(time.monotonic())
                started.set()
                if done.is_set():
                    break

    t = threading.Thread(target=stream)
    t.start()
    try:
        assert started.wait(60)
        t0 = time.monotonic()
        response = request()
        t1 = time.monotonic()
        time.sleep(0.2)  # a stall would show as a gap that ends after the request did
    finally:
        done.set()
        t.join(timeout=60)
    during = [t for t in arrivals if t0 <= t <= t1 + 0.2]
    assert len(during) >= 2, "the stream sent nothing while the request ran"
    gaps = [b - a for a, b in zip(during, during[1:])] + [during[0] - t0]
    return max(gaps), response


def test_a_6mb_prompt_is_refused_by_its_size_while_another_stream_flows(server):
    text = "lorem ipsum " * (6 * 2**20 // 12)
    with server.client() as c:
        gap, r = largest_gap_during(server, lambda: c.post("/v1/completions", json={"prompt": text, "max_tokens": 4}))
    assert r.status_code == 400, r.text
    message = r.json()["error"]["message"]
    assert f"{len(text)} characters" in message and "slot context of 65536 tokens" in message
    assert r.elapsed.total_seconds() < 2.0  # milliseconds when the machine is idle: nothing is tokenized
    assert gap < MAX_GAP_S


def test_a_long_prompt_that_may_fit_is_tokenized_off_the_event_loop(server):
    text = "lorem ipsum " * (800_000 // 12)  # under the size bound: tokenized, then found too long
    with server.client() as c:
        gap, r = largest_gap_during(server, lambda: c.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": text}], "max_tokens": 4}))
    assert r.status_code == 400 and "slot context is 65536" in r.json()["error"]["message"], r.text
    assert gap < MAX_GAP_S


def test_memory_a_big_body_took_is_given_back(server):
    text = "lorem ipsum " * (6 * 2**20 // 12)
    with server.client() as c:
        assert c.post("/v1/completions", json={"prompt": "warm", "max_tokens": 2}).status_code == 200
        before = rss_kb(server.proc.pid)
        for path, body in (("/v1/completions", {"prompt": text}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]})):
            assert c.post(path, json=body).status_code == 400
        after = rss_kb(server.proc.pid)
    assert after - before < 100 * 1024, (before, after)
