"""The soak's tally (bench/soak.py) reads each answer as the issue counts it: a stream with its
finish_reason and [DONE] completed; one ended by an error event and [DONE] cut, with its reason;
a 503 unavailable, tried again after its Retry-After; a stream that just stops lost."""
from __future__ import annotations

import asyncio
import json
import random

import httpx

from bench.soak import Tally, one_request

FINISHED = [{"choices": [{"text": "a", "finish_reason": None}]}, {"choices": [{"text": "b", "finish_reason": "length"}]}]
CUT = [{"choices": [{"text": "a", "finish_reason": None}]}, {"error": {"message": "the server was killed", "code": 502}}]


def sse(events: list[dict], done: bool) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + (b"data: [DONE]\n\n" if done else b"")


def tally_of(response: httpx.Response) -> tuple[Tally, float, dict]:
    """The tally after one valid streamed request answered with `response`, the wait it asked for, and
    the body it sent."""
    sent = {}

    def answer(request: httpx.Request) -> httpx.Response:
        sent.update(json.loads(request.content))
        return response

    async def once() -> tuple[Tally, float]:
        tally = Tally("test")
        async with httpx.AsyncClient(transport=httpx.MockTransport(answer), base_url="http://soak") as http:
            # seed 3's first roll is neither an invalid body nor a client that leaves early
            wait = await one_request(http, tally, random.Random(3), 1, 20, "smollm2")
        return tally, wait

    tally, wait = asyncio.run(once())
    return tally, wait, sent


def test_a_stream_with_its_finish_reason_and_done_completes_and_names_the_model():
    tally, wait, sent = tally_of(httpx.Response(200, content=sse(FINISHED, done=True)))
    assert (tally.completed, tally.lost, tally.cut, wait) == (1, 0, 0, 0.0)
    assert sent["model"] == "smollm2" and sent["stream"] is True and len(tally.ttft_ms) == 1


def test_a_stream_ended_by_an_error_event_and_done_is_cut_with_its_reason():
    tally, _, _ = tally_of(httpx.Response(200, content=sse(CUT, done=True)))
    assert (tally.completed, tally.cut, tally.lost) == (0, 1, 0)
    assert tally.reasons == {"cut: the server was killed": 1}


def test_a_stream_that_stops_without_done_is_lost_even_after_an_error_event():
    for events in (FINISHED[:1], CUT):
        tally, _, _ = tally_of(httpx.Response(200, content=sse(events, done=False)))
        assert (tally.completed, tally.cut, tally.lost) == (0, 0, 1) and tally.problems


def test_a_503_is_unavailable_and_waits_its_retry_after_at_most_5_s():
    body = {"error": {"message": "the proxy is shutting down", "code": 503}}
    tally, wait, _ = tally_of(httpx.Response(503, json=body, headers={"Retry-After": "5"}))
    assert (tally.unavailable, tally.lost, tally.server_errors, wait) == (1, 0, 0, 5.0)
    assert tally.reasons == {"503: the proxy is shutting down": 1}
    assert tally_of(httpx.Response(503, json=body, headers={"Retry-After": "120"}))[1] == 5.0


def test_the_summary_keeps_each_reason_with_its_count():
    tally = Tally("test", ttft_ms=[10.0, 30.0, 20.0])
    tally.reasons.update(["cut: killed", "cut: killed", "503: draining"])
    summary = json.loads(json.dumps(tally.summary()))
    assert summary["reasons"] == {"cut: killed": 2, "503: draining": 1} and summary["ttft_p50_ms"] == 20.0
