"""bench.fair_share's judgement: a stream waits (arrival to admission, its first token less its
prompt time) no longer than the streams ahead of it take to end, plus a slack; every stream must
end with a finish_reason and [DONE]."""
from __future__ import annotations

from bench.fair_share import SLACK_S, StreamRecord, judge


def record(arrival: int, sent: float, first: float, end: float, prompt_ms: float = 0.0, done: bool = True):
    return StreamRecord(arrival, 1000, sent=sent, first=first, end=end, prompt_ms=prompt_ms, finish_reason="length",
                        done=done, gaps=[0.1])


def test_a_stream_admitted_once_those_ahead_of_it_ended_is_within_its_share():
    # the second waits for the first to end at 5 s, then prefills for 1 s
    report = judge([record(0, 0.0, 2.0, 5.0, prompt_ms=2000), record(1, 0.05, 6.0, 9.0, prompt_ms=1000)])
    assert report["all_finished"] and report["all_within_fair_share"]
    assert [s["bound_s"] for s in report["streams"]] == [SLACK_S, round(5.0 - 0.05 + SLACK_S, 2)]


def test_a_stream_held_back_past_every_stream_ahead_of_it_is_not():
    # the first waits while the later one runs to its end: it was overtaken, beyond any FIFO turn
    report = judge([record(0, 0.0, 7.0, 9.0, prompt_ms=1000), record(1, 0.05, 2.0, 5.0, prompt_ms=2000)])
    assert not report["all_within_fair_share"]
    first = report["streams"][0]
    assert not first["within"] and first["waited_s"] == 6.0 and first["overtaken_by"] == 1


def test_a_stream_without_done_has_not_finished():
    assert not judge([record(0, 0.0, 1.0, 2.0, done=False)])["all_finished"]
