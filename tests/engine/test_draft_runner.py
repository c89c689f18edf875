"""DraftRunner, the engine's one call into speculation, with a drafter that records what it is
given: drafts reach their requests; past max_batch a drafter with a cache is owed the committed
spans and catches up in one call, when the request drafts again, owes a chunk, or finishes; a
request that leaves drops what it owes; a failing draft fails its own request only."""
from __future__ import annotations

import torch

from engine.sched.request import Draft, Request, Status
from engine.sched.sampling import SamplingParams
from engine.settings import DraftLimits
from engine.spec.drafter import Span
from engine.spec.runner import DraftRunner

LIMITS = DraftLimits(n_max=3, n_min=0, p_min=0.0)


class RecordingDrafter:
    """Drafts [7] for every decoding request with room; records (request id, start, end, hidden
    rows, room) per call."""
    needs_hidden = True

    def __init__(self, has_cache: bool = True, poison: str | None = None):
        self.has_cache, self.poison, self.calls = has_cache, poison, []

    def draft(self, spans: list[Span]) -> dict[Request, Draft]:
        if self.poison is not None and any(s.request.id == self.poison for s in spans):
            raise RuntimeError("poisoned")
        self.calls.append([(s.request.id, s.start, s.end, s.hidden[:, 0].tolist(), s.room) for s in spans])
        return {s.request: Draft([7]) for s in spans if not s.request.prefilling and s.room > 0}

    def resident(self) -> None:
        return None


def decoding(name: str, slot: int, length: int) -> Request:
    """A request past its prompt, its `length` tokens all but the last in its slot."""
    req = Request(name, list(range(length - 1)), SamplingParams(temperature=0), on_output=None, draft_limits=LIMITS)
    req.token_ids.append(1)
    req.admit(slot, length - 1, now=0.0)
    return req


def step(req: Request, n: int = 1) -> Span:
    """The request commits n more positions; its span, the hidden states numbered by position."""
    start = req.num_computed
    req.commit(n)
    req.token_ids.extend([1] * n)
    hidden = torch.arange(start, start + n, dtype=torch.float32)[:, None]
    return Span(req, start, start + n, hidden, room=8)


def runner(drafter, max_batch: int = 1, chunk: int = 128) -> tuple[DraftRunner, list[Request]]:
    failed = []
    return DraftRunner(drafter, max_batch, failed.append, catch_up_chunk=chunk), failed


def test_under_max_batch_every_decoding_request_drafts_each_step():
    drafter = RecordingDrafter()
    run, _ = runner(drafter, max_batch=2)
    a, b = decoding("a", 0, 5), decoding("b", 1, 5)
    run.after_step([step(a), step(b)], [])
    assert [[(c[0], c[1], c[2]) for c in call] for call in drafter.calls] == [[("a", 4, 5), ("b", 4, 5)]]
    assert a.draft.tokens == [7] and b.draft.tokens == [7]


def test_past_max_batch_a_cached_drafter_is_owed_and_catches_up_in_one_call_when_drafting_resumes():
    drafter = RecordingDrafter()
    run, _ = runner(drafter)
    a, b = decoding("a", 0, 5), decoding("b", 1, 5)
    for _ in range(3):
        run.after_step([step(a), step(b)], [])
    assert drafter.calls == [] and a.draft.tokens == []
    run.after_step([step(a)], [])  # b is elsewhere (e.g. prefilling again): a alone decodes
    [[(name, start, end, hidden, room)]] = drafter.calls
    assert (name, start, end, hidden, room) == ("a", 4, 8, [4.0, 5.0, 6.0, 7.0], 8)
    assert a.draft.tokens == [7]


def test_an_owed_chunk_is_caught_up_without_drafting():
    drafter = RecordingDrafter()
    run, _ = runner(drafter, chunk=3)
    a, b = decoding("a", 0, 5), decoding("b", 1, 5)
    run.after_step([step(a), step(b)], [])
    run.after_step([step(a), step(b)], [])
    assert drafter.calls == []
    run.after_step([step(a), step(b)], [])  # three owed positions each: the chunk
    [call] = drafter.calls
    assert [(c[0], c[1], c[2], c[4]) for c in call] == [("a", 4, 7, 0), ("b", 4, 7, 0)]
    assert a.draft.tokens == [] and b.draft.tokens == []


def test_a_finished_request_catches_up_what_it_owes():
    drafter = RecordingDrafter()
    run, _ = runner(drafter)
    a, b = decoding("a", 0, 5), decoding("b", 1, 5)
    run.after_step([step(a), step(b)], [])
    step(b)
    b.finish("length")
    run.after_step([step(a)], [b])
    [call] = drafter.calls
    assert [(c[0], c[1], c[2]) for c in call] == [("b", 4, 5), ("a", 4, 6)]


def test_a_request_that_leaves_or_is_preempted_owes_nothing_more():
    drafter = RecordingDrafter()
    run, _ = runner(drafter)
    a, b, c = decoding("a", 0, 5), decoding("b", 1, 5), decoding("c", 2, 5)
    run.after_step([step(a), step(b), step(c)], [])
    run.forget(b)  # cancelled
    c.preempt()
    assert c.status is Status.WAITING
    run.after_step([step(a)], [b])
    assert [[(x[0], x[1]) for x in call] for call in drafter.calls] == [[("a", 4)]]


def test_a_drafter_without_a_cache_is_never_owed():
    drafter = RecordingDrafter(has_cache=False)
    run, _ = runner(drafter)
    a, b = decoding("a", 0, 5), decoding("b", 1, 5)
    run.after_step([step(a), step(b)], [])
    [call] = drafter.calls
    assert [(c[0], c[1], c[2], c[4]) for c in call] == [("a", 4, 5, 0), ("b", 4, 5, 0)]  # no room: no draft
    assert a.draft.tokens == [] and b.draft.tokens == []


def test_a_failing_draft_fails_its_own_request_and_the_others_still_draft():
    drafter = RecordingDrafter(poison="b")
    run, failed = runner(drafter, max_batch=0)
    a, b = decoding("a", 0, 5), decoding("b", 1, 5)
    run.after_step([step(a), step(b)], [])
    assert failed == [b]
    assert a.draft.tokens == [7] and b.draft.tokens == []


def test_a_request_whose_drafting_loses_pauses_owing_its_spans_then_tries_again_caught_up():
    # Timed alone, its plain steps take 10 ms and its drafted ones 30 ms for 2 tokens: drafting
    # loses (gain 0.67), so the drafter sees nothing for a pause, then the paused positions at once.
    from engine.spec import pacing
    drafter = RecordingDrafter()
    run, _ = runner(drafter, max_batch=0)
    a = decoding("a", 0, 5)
    drafted_steps = []
    for _ in range(1 + pacing.LEAST_SAMPLES + pacing.PAUSE + pacing.TRIAL):
        drafted = bool(a.draft.tokens)
        drafted_steps.append(drafted)
        a.draft = Draft()
        run.observe(a, a.num_computed, 0.030 if drafted else 0.010, drafted, 2 if drafted else 1)
        run.after_step([step(a, 2 if drafted else 1)], [])
    # Its first step verified nothing (a plain time); once enough drafted steps say the gain is
    # below 1, it pauses; then the trial drafts again.
    assert drafted_steps == [False] + [True] * pacing.LEAST_SAMPLES + [False] * pacing.PAUSE + [True] * pacing.TRIAL
    assert len(drafter.calls) == pacing.LEAST_SAMPLES + pacing.TRIAL  # none during the pause
    # The trial's first call: the last drafted step's 2 tokens and the pause's one a step, at once.
    first_trial = drafter.calls[pacing.LEAST_SAMPLES]
    assert [(name, end - start) for name, start, end, _, _ in first_trial] == [("a", 2 + pacing.PAUSE)]
