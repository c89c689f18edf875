"""The step planner the server relies on: FIFO admission into N slots, decode rows batched with
ubatch-sized prompt chunks, prefix reuse, cancellation freeing the slot."""
from __future__ import annotations

from engine.model.kv_cache import PagedKVCache
from engine.sched.request import Request
from engine.sched.sampling import SamplingParams
from engine.sched.scheduler import Scheduler


def request(prompt: list[int], **kwargs) -> Request:
    return Request(f"r{prompt[0]}-{len(prompt)}", prompt, SamplingParams(max_tokens=8), lambda out: None, **kwargs)


def decode(s: Scheduler, req: Request, token: int) -> None:
    """Pretend the engine sampled `token` for req after a step."""
    req.token_ids.append(token)


def test_long_prompt_prefills_in_chunks_beside_other_slots_decode():
    s = Scheduler(num_slots=2, ctx_per_slot=1024, batch_size=2048, ubatch_size=64)
    short, long = request([1, 2, 3]), request(list(range(10, 310)))
    s.add(short)
    (row,) = s.plan(0.0).rows
    s.commit(short, row.row.tokens)
    decode(s, short, 7)
    s.add(long)
    for step in range(4):
        rows = s.plan(1.0).rows
        assert [len(r.row.tokens) for r in rows] == [1, 64]  # one decode token, one prompt chunk
        assert rows[0].request is short and rows[0].samples and not rows[1].samples
        for r in rows:
            s.commit(r.request, r.row.tokens)
        decode(s, short, 7)
    rows = s.plan(2.0).rows
    assert [len(r.row.tokens) for r in rows] == [1, 300 - 4 * 64] and rows[1].samples


def test_requests_beyond_the_slots_wait_in_fifo_order_and_a_release_frees_the_slot():
    s = Scheduler(num_slots=1, ctx_per_slot=256, batch_size=512, ubatch_size=64)
    a, b, c = request([1, 1]), request([2, 2]), request([3, 3])
    for r in (a, b, c):
        s.add(r)
    s.plan(0.0)
    assert s.running == [a] and list(s.waiting) == [b, c]
    s.release(a)  # a cancel or a finish
    s.plan(0.0)
    assert s.running == [b] and list(s.waiting) == [c]


def test_prefix_reuse_picks_the_slot_holding_the_prompt_start_unless_disabled():
    s = Scheduler(num_slots=2, ctx_per_slot=256, batch_size=512, ubatch_size=64)
    s.slots[1].cached_ids = [5, 6, 7, 8, 9]
    reuse = request([5, 6, 7, 1])
    s.add(reuse)
    s.plan(0.0)
    assert reuse.slot == 1 and reuse.cache_n == 3
    s.release(reuse)
    fresh = request([5, 6, 7, 2], cache_prompt=False)
    s.add(fresh)
    s.plan(0.0)
    assert fresh.cache_n == 0 and fresh.slot == 0


def test_a_request_pinned_to_a_busy_slot_does_not_hold_back_the_next_one():
    s = Scheduler(num_slots=2, ctx_per_slot=256, batch_size=512, ubatch_size=64)
    first, pinned, free = request([1, 1], pinned_slot=0), request([2, 2], pinned_slot=0), request([3, 3])
    for r in (first, pinned, free):
        s.add(r)
    s.plan(0.0)
    assert first.slot == 0 and free.slot == 1 and list(s.waiting) == [pinned]


def test_a_preempted_request_resumes_at_the_queue_head_recomputing_prompt_and_outputs():
    pool = PagedKVCache(num_layers=0, num_slots=2, capacity=64, kv_heads=0, head_dim=0)
    s = Scheduler(num_slots=2, ctx_per_slot=64, batch_size=512, ubatch_size=64, kv=pool, draft_max=3)
    older, younger, later = request([1] * 20), request([2] * 20), request([3] * 4)
    s.add(older)
    s.plan(0.0)
    s.add(younger)
    for step in range(30):  # both decode until the 64-position pool (4 pages of 16) runs out
        plan = s.plan(1.0 + step)
        if plan.preempted:
            break
        for r in plan.rows:
            s.commit(r.request, r.row.tokens)
            if r.samples:
                decode(s, r.request, 9)
    assert plan.preempted == [younger] and [r.request for r in plan.rows] == [older]
    assert younger.slot is None and younger.num_computed == 0 and younger.output_ids
    dropped = younger.dropped_n
    assert dropped == len(younger.token_ids) - 1
    s.add(later)
    assert list(s.waiting) == [younger, later]
    s.release(older)
    rows = {r.request.id: r for r in s.plan(20.0).rows}  # room again: both are admitted
    row = rows[younger.id]
    assert row.row.tokens == younger.token_ids[:-1] and not row.samples
    assert younger.recomputed_n == dropped and younger.cache_n == 0
