"""q8_0 KV cache (-ctk/-ctv q8_0): int8 with one scale per block of 32, read back as float32.
Greedy tokens with it follow the exact-token rule against the f32 cache on the default model."""
from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.model.batch import ForwardBatch, Row
from engine.model.kv_cache import KVCache, PagedKVCache, Q8Storage
from engine.sched.sampling import SamplingParams
from engine.settings import EngineConfig
from tests.exact_tokens import assert_same_greedy


def test_q8_round_trip_error_is_within_half_a_step_per_block():
    store = Q8Storage((2, 3, 64))
    x = torch.randn(2, 3, 64) * torch.logspace(-3, 2, 64)  # blocks of very different magnitude
    store[:, :, :] = x
    step = x.unflatten(-1, (2, 32)).abs().amax(-1, keepdim=True) / 127
    err = (store[:, :, :] - x).unflatten(-1, (2, 32)).abs()
    assert (err <= step * 0.51 + 1e-6).all()
    assert store.nbytes == 2 * 3 * 64 + 2 * 2 * 3 * 2


@pytest.mark.parametrize("cache_cls", [KVCache, PagedKVCache])
def test_q8_caches_read_back_what_was_written(cache_cls):
    cache = cache_cls(1, 2, 64, 2, 16, torch.int8, torch.int8)  # head_dim 16: one block per vector
    for slot in (0, 1):
        assert cache.ensure(slot, 10)
    k = torch.randn(2, 10, 16)
    cache.write(0, 1, 0, k, 2 * k)
    keys, values = cache.read(0, 1, 10)
    assert keys.dtype == torch.float32
    assert torch.allclose(keys, k, atol=k.abs().max() / 100) and torch.allclose(values, 2 * k, atol=k.abs().max() / 50)


@pytest.mark.parametrize("cache_cls", [KVCache, PagedKVCache])
@pytest.mark.parametrize("kv_type", [torch.float32, torch.int8])
def test_reading_some_positions_gives_those_of_a_whole_read(cache_cls, kv_type):
    # A sparse query's keys (engine/model/attention.py, an indexed layer) are read alone.
    cache = cache_cls(1, 2, 128, 2, 32, kv_type, kv_type)
    for slot in (0, 1):
        assert cache.ensure(slot, 40)
    cache.write(0, 1, 0, torch.randn(2, 40, 32), torch.randn(2, 40, 32))
    positions = torch.tensor([0, 5, 6, 7, 33, 39])
    keys, values = cache.read(0, 1, 40)
    some_keys, some_values = cache.read_at(0, 1, positions)
    assert torch.equal(some_keys, keys[:, positions]) and torch.equal(some_values, values[:, positions])


@pytest.fixture
def one_thread():
    # Two engines stepping inline on a machine shared with colleagues: a second thread mostly waits.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_q8_cache_keeps_greedy_tokens_of_the_default_model(default_engine, one_thread):
    q8 = Engine.load(EngineConfig(model="default", ctx_size=256, parallel=1, cache_type="q8_0"))
    model = default_engine.model
    c = model.config

    def reference_logits(ids: list[int]) -> torch.Tensor:
        cache = KVCache(c.num_layers, 1, len(ids), c.num_kv_heads, c.head_dim)
        hidden = model(ForwardBatch.build([Row(0, 0, ids)]), cache)
        return model.logits(hidden[-1:])[0]

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    for text in ("The capital of France is", "def fibonacci(n):"):
        ids = default_engine.tokenizer.encode(text)
        expected = list(default_engine.generate(ids, params, cache_prompt=False))[-1].request.output_ids
        got = list(q8.generate(ids, params, cache_prompt=False))[-1].request.output_ids
        assert_same_greedy(got, expected, ids, reference_logits)
