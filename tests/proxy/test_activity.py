"""The ring buffer behind GET /activity: the last requests' speeds, oldest first, odd timings ignored."""
from __future__ import annotations

from proxy.activity import Activity


def timings(n: int) -> dict:
    return {"prompt_n": n, "prompt_per_second": 10.0 * n, "predicted_n": 2 * n, "predicted_per_second": 1.5 * n,
            "draft_n": 4, "draft_n_accepted": 3}


def test_keeps_the_last_requests_oldest_first():
    activity = Activity(size=3)
    for n in range(1, 6):
        activity.record("m", timings(n), now=float(n))
    assert [r["prompt_n"] for r in activity.recent(10)] == [3, 4, 5]
    assert activity.recent(1) == [{"time": 5.0, "model": "m", "prompt_n": 5, "predicted_n": 10,
                                   "prompt_per_second": 50.0, "predicted_per_second": 7.5, "draft_n": 4,
                                   "draft_n_accepted": 3}]


def test_odd_timings_are_left_out_and_missing_fields_count_as_zero():
    activity = Activity()
    activity.record("m", {"prompt_n": "many"})
    activity.record("m", ["not", "a", "dict"])
    activity.record("m", {"predicted_n": 7})
    [only] = activity.recent(10)
    assert (only["predicted_n"], only["prompt_n"], only["predicted_per_second"]) == (7, 0, 0.0)
