"""The shared KV pool behind --kv-unified: page bookkeeping, reads equal writes, and what happens
when the pool runs out mid-generation (the youngest request is paused, then resumes and finishes)."""
from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.model.kv_cache import PagedKVCache, PagePool
from engine.sched.sampling import SamplingParams
from engine.settings import EngineConfig, SpecConfig
from tests.engine.runs import run_all


def test_pool_gives_contiguous_pages_when_it_can_and_takes_nothing_when_short():
    pool = PagePool(num_pages=6, page_size=4, num_slots=2)
    assert pool.ensure(0, 5) and pool.pages[0] == [0, 1]
    assert pool.ensure(1, 4) and pool.pages[1] == [2]
    assert pool.ensure(0, 9) and pool.pages[0] == [0, 1, 3]
    assert not pool.ensure(1, 17) and pool.pages[1] == [2] and pool.num_free == 2
    pool.truncate(0, 4)
    assert pool.pages[0] == [0] and pool.num_free == 4
    assert pool.ensure(1, 8) and pool.pages[1] == [2, 3]


def test_paged_reads_return_what_was_written_for_interleaved_slots():
    cache = PagedKVCache(num_layers=1, num_slots=2, capacity=64, kv_heads=2, head_dim=3)
    written = {0: [], 1: []}
    for step in range(20):  # alternate slots so their pages interleave: the gather path
        for slot in (0, 1):
            n = len(written[slot])
            assert cache.ensure(slot, n + 1)
            k = torch.randn(2, 1, 3)
            cache.write(0, slot, n, k, -k)
            written[slot].append(k)
    for slot in (0, 1):
        keys, values = cache.read(0, slot, 20)
        expected = torch.cat(written[slot], dim=1)
        assert torch.equal(keys, expected) and torch.equal(values, -expected)


@pytest.fixture(scope="module")
def engines(tiny_model):
    # A tiny model's ops are too small to gain from a second thread, and a shared machine punishes it.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    split = Engine.load(EngineConfig(model=str(tiny_model), ctx_size=512, parallel=2))
    unified = Engine.load(EngineConfig(model=str(tiny_model), ctx_size=160, parallel=2, kv_unified=True))
    yield split, unified
    torch.set_num_threads(threads)


def test_unified_pool_gives_the_same_greedy_tokens(engines):
    split, unified = engines
    prompts = [list(range(300, 300 - 1 - i * 7, -1))[:20 + i] for i in range(2)]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    a = run_all(split, prompts, params)
    b = run_all(unified, prompts, params)
    assert [r.output_ids for r in a] == [r.output_ids for r in b]
    assert all(r.finish_reason == "length" and len(r.output_ids) == 40 for r in b)


def test_exhausted_pool_pauses_the_youngest_which_resumes_and_equals_its_output_alone(engines):
    split, unified = engines  # 160 positions for two requests that want 40 + 100 each
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    prompts = [[65] * 40, [66] * 40]
    before = unified.stats.preemptions
    older, younger = run_all(unified, prompts, params)
    assert unified.stats.preemptions > before
    alone = [run_all(split, [p], params)[0] for p in prompts]
    for got, ref in zip((older, younger), alone):
        assert got.finish_reason == "length" and got.output_ids == ref.output_ids
    assert older.recomputed_n == 0 and younger.recomputed_n > 0
    assert (younger.cache_n, younger.prompt_n) == (0, 40)  # the original prompt's, not the recomputation's
    again = run_all(unified, [[67] * 10], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert len(again.output_ids) == 20


def test_many_requests_on_a_small_pool_all_finish_with_every_token(tiny_model):
    """Eight requests on four slots sharing 256 positions, each wanting 20 + 90: preemption pauses
    and resumes them, nothing ends early, and each equals its output alone."""
    unified = Engine.load(EngineConfig(model=str(tiny_model), ctx_size=256, parallel=4, kv_unified=True))
    params = SamplingParams(temperature=0, max_tokens=90, ignore_eos=True)
    prompts = [[70 + i] * (15 + i) for i in range(8)]
    got = run_all(unified, prompts, params)
    assert unified.stats.preemptions > 0
    alone = Engine.load(EngineConfig(model=str(tiny_model), ctx_size=256, parallel=1))
    for req, prompt in zip(got, prompts):
        ref = run_all(alone, [prompt], params)[0]
        assert req.finish_reason == "length" and req.output_ids == ref.output_ids


def test_a_resumed_request_rebuilds_its_drafters_cache(tiny_model):
    """The target drafting for itself accepts every draft, so a drafter whose cache was not rebuilt
    after preemption would show as a rejected draft."""
    spec = SpecConfig(pacing=False, type="draft-simple", draft_model=str(tiny_model), n_max=3, p_min=0.0)
    unified = Engine.load(EngineConfig(model=str(tiny_model), ctx_size=160, parallel=2, kv_unified=True, spec=spec))
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    prompts = [[65] * 40, [66] * 40]
    got = run_all(unified, prompts, params)
    assert unified.stats.preemptions > 0
    alone = Engine.load(EngineConfig(model=str(tiny_model), ctx_size=256, parallel=1))
    for req, prompt in zip(got, prompts):
        assert req.output_ids == run_all(alone, [prompt], params)[0].output_ids
        assert req.draft_n > 0 and req.draft_n_accepted == req.draft_n
