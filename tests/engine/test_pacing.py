"""Pacing (engine/spec/pacing.py): drafting pauses where its measured gain falls below 1 and comes
back when it pays again; step times are the engine's per context span, tokens each request's own;
a request that shares its steps never takes a plain step to measure."""
from __future__ import annotations

import random

from engine.spec import pacing
from engine.spec.pacing import Pacer


def run(pacer: Pacer, steps: int, plain: float, drafted: float, tokens, request="a", context: int = 100,
        rng: random.Random | None = None) -> list[bool]:
    """Steps of one request running alone, whose plain step takes `plain` seconds and whose drafted
    one `drafted` seconds for `tokens` tokens (a list: one drawn per step; times then within 10%);
    which of them drafted."""
    decisions = []
    for _ in range(steps):
        d = pacer.wants_draft(request, context, alone=True)
        decisions.append(d)
        noise = rng.uniform(0.9, 1.1) if rng else 1.0
        k = (rng.choice(tokens) if rng else tokens) if d else 1
        pacer.observe(request, context, (drafted if d else plain) * noise, d, k)
    return decisions


def test_drafting_that_pays_keeps_drafting_with_a_rare_plain_step():
    pacer = Pacer()
    decisions = run(pacer, 200, plain=0.010, drafted=0.014, tokens=2)  # gain 1.43
    assert decisions[:pacing.LEAST_SAMPLES] == [True] * pacing.LEAST_SAMPLES
    assert decisions[pacing.LEAST_SAMPLES] is False  # the first plain step: the first gain
    assert abs(pacer.gain("a", 100) - 2 * 0.010 / 0.014) < 1e-9
    later = decisions[pacing.LEAST_SAMPLES + 1:]
    assert later.count(False) == len(later) // (pacing.PLAIN_EVERY + 1)  # one plain step in PLAIN_EVERY + 1


def test_drafting_that_loses_pauses_longer_each_time_it_still_loses():
    pacer = Pacer()
    decisions = run(pacer, 400, plain=0.010, drafted=0.025, tokens=2)  # gain 0.8
    assert decisions.count(True) < 0.1 * len(decisions)
    pauses, length = [], 0  # runs of plain steps between the trials
    for d in decisions[pacing.LEAST_SAMPLES + 1:]:
        if d and length:
            pauses.append(length)
            length = 0
        elif not d:
            length += 1
    assert pauses[:3] == [pacing.PAUSE, 2 * pacing.PAUSE, 4 * pacing.PAUSE]
    assert max(pauses) == pacing.LONGEST_PAUSE


def test_drafting_comes_back_when_it_pays_again():
    pacer = Pacer()
    run(pacer, 100, plain=0.010, drafted=0.025, tokens=2)  # loses: paused
    assert pacer.gain("a", 100) < 1
    decisions = run(pacer, 600, plain=0.010, drafted=0.012, tokens=3)  # say the text turned repetitive
    assert pacer.gain("a", 100) > 1
    assert decisions[-pacing.PLAIN_EVERY:].count(False) <= 1


def test_a_new_request_starts_from_what_the_engine_measured_at_its_context():
    pacer = Pacer()
    run(pacer, 100, plain=0.010, drafted=0.025, tokens=2, request="long", context=5000)
    # Another request at the same context pauses at once; one at a short context has no times yet.
    assert pacer.wants_draft("next", 5100, alone=True) is False
    assert pacer.wants_draft("short", 200, alone=True) is True


def test_a_request_sharing_its_steps_drafts_and_never_probes():
    pacer = Pacer()
    for _ in range(50):
        assert pacer.wants_draft("a", 100, alone=False)
        pacer.observe("a", 100, None, True, 2)
    assert pacer.gain("a", 100) is None


def test_a_catch_up_step_is_not_a_sample():
    pacer = Pacer()
    pacer.observe("a", 100, None, True, 3)  # its draft came with a catch-up: tokens count, seconds do not
    assert pacer.tokens.value == 3 and pacer.times[0].drafted.value is None


def noisy(drafted_seconds: float, steps: int = 2000) -> tuple[float, float]:
    """Requests of 64 steps, one after another, at short context: 1 to 4 tokens a drafted step
    (2.17 on average), times within 10% of 5.5 ms plain and `drafted_seconds` drafted. (The share
    of steps that drafted, tokens per second over them all.)"""
    rng, pacer, decisions, tokens, seconds = random.Random(0), Pacer(), [], 0, 0.0
    for i in range(steps // 64):
        for _ in range(64):
            d = pacer.wants_draft(i, 300, alone=True)
            t = (drafted_seconds if d else 0.0055) * rng.uniform(0.9, 1.1)
            k = rng.choice([1, 1, 2, 2, 3, 4]) if d else 1
            pacer.observe(i, 300, t, d, k)
            decisions.append(d)
            tokens, seconds = tokens + k, seconds + t
        pacer.forget(i)
    return sum(decisions) / len(decisions), tokens / seconds


def test_noisy_steps_of_drafting_that_pays_little_seldom_pause_it():
    # Open chat at short context, a true gain of 1.15: a pause for a streak of rejections loses.
    share, rate = noisy(0.0104)
    assert share > 0.97 and rate > 1.1 / 0.0055


def test_noisy_steps_of_drafting_that_loses_keep_nearly_the_plain_rate():
    share, rate = noisy(0.014)  # a true gain of 0.85: drafting on every step would give 0.85x
    assert share < 0.1 and rate > 0.97 / 0.0055
