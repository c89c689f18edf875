"""Summary figures checked against a hand computation on given records."""
from __future__ import annotations

import pytest
from rich.console import Console

from bench.summary import Spread, percentile, render, summarize
from tests.bench.test_records import served

CONFIG = {"url": "http://x", "model": "m", "prompt_tokens": 64, "gen_tokens": 16, "lanes": 2, "runs": 3}


def rec(lane, run, tg, ttft, itl, start, end, draft=None, **changes):
    drafted = {"draft_n": draft[0], "draft_n_accepted": draft[1]} if draft else {}
    return served(lane=lane, run=run, predicted_per_second=tg, prompt_per_second=10 * tg, ttft_ms=ttft, itl_ms=itl,
                  start_s=start, end_s=end, **drafted, **changes)


RECORDS = [
    rec(0, 0, 100.0, 10.0, [1.0, 3.0], 0.0, 2.0, draft=(10, 5)),
    rec(1, 0, 80.0, 40.0, [2.0], 0.0, 4.0, draft=(10, 9)),
    rec(0, 1, 120.0, 30.0, [4.0], 5.0, 6.0, draft=(4, 1)),
    rec(1, 1, 200.0, 1.0, [0.5], 5.0, 6.0, draft=(100, 100), cache_n=5, prompt_n=59),  # invalid: reused prefix
    rec(0, 2, 90.0, 20.0, [5.0], 10.0, 12.0),
    rec(1, 2, 95.0, 50.0, [6.0], 10.5, 11.0),
]


def test_percentile_interpolates_between_ranks():
    assert percentile([50, 10, 40, 20, 30], 50) == 30
    assert percentile([10, 20, 30, 40, 50], 90) == pytest.approx(46.0)  # rank 3.6
    assert percentile([10, 20, 30, 40, 50], 99) == pytest.approx(49.6)
    assert percentile([7.0], 99) == 7.0


def test_lane_and_overall_figures_come_from_valid_records_only():
    s = summarize(RECORDS, CONFIG)
    lane0, lane1, overall = s.scopes
    assert (lane0.name, lane0.records, lane0.valid) == ("lane 0", 3, 3)
    assert lane0.tg == Spread(100.0, 90.0, 120.0)
    assert (lane1.records, lane1.valid) == (3, 2)
    assert lane1.tg == Spread(87.5, 80.0, 95.0)  # 200 tok/s came from a reused prefix
    assert overall.tg == Spread(95.0, 80.0, 120.0)
    assert overall.pp == Spread(950.0, 800.0, 1200.0)
    assert (overall.ttft_ms.p50, overall.ttft_ms.p90, overall.ttft_ms.p99) == pytest.approx((30.0, 46.0, 49.6))
    # Gaps pooled over requests: 1, 3, 2, 4, 5, 6.
    assert overall.itl_ms.p50 == pytest.approx(3.5)


def test_rounds_give_acceptance_and_aggregate_throughput():
    s = summarize(RECORDS, CONFIG)
    assert [r.acceptance for r in s.rounds] == pytest.approx([14 / 20, 1 / 4, None])
    assert [r.clean for r in s.rounds] == [True, False, True]
    assert [r.wall_s for r in s.rounds] == pytest.approx([4.0, 1.0, 2.0])
    assert [r.aggregate_tg for r in s.rounds] == pytest.approx([8.0, 32.0, 16.0])  # 32 tokens per round
    assert s.aggregate_tg == Spread(12.0, 8.0, 16.0)  # the unclean round is left out


def test_invalid_records_are_counted_by_reason_and_shown():
    s = summarize(RECORDS, CONFIG, interrupted=True)
    assert (s.records, s.valid) == (6, 5)
    assert s.invalid == {"cache_n=5: prompt tokens reused from the cache; prompt_n=59 != prompt_tokens=64": 1}
    console = Console(record=True, width=140)
    console.print(render(s))
    text = console.export_text()
    assert "model=m" in text and "invalid records: 1 of 6" in text and "interrupted" in text
    assert s.to_json()["rounds"][0]["aggregate_tg"] == pytest.approx(8.0)
