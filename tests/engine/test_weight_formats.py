"""`--dtype auto` on the default model, whose file stores Q4_1 blocks and a Q8_0 embedding: the
weights stay the file's blocks in memory, and with f32 activations the logits equal the f32 path's
(which reads the same file dequantized) up to summation order, through prefill, decode, two slots
and MTP verification. With 8-bit activations (`--activations q8`, where the CPU has VNNI) they are
other numbers, and speculation and batching still give exactly the tokens of one request alone."""
from __future__ import annotations

import pytest
import torch

from engine import cpu
from engine.files.nearest_format import stored_formats
from engine.errors import ConfigError
from engine.engine import Engine
from engine.model.batch import ForwardBatch, Row
from engine.model.kv_cache import KVCache
from engine.sched.sampling import SamplingParams
from engine.settings import EngineConfig, SpecConfig
from tests.engine.test_generation import chat_ids, run_alone, run_together
from tests.engine.test_spec_decoding import MTP_DRAFT
from tests.exact_tokens import assert_same_greedy

RELATIVE = 1e-4
GREEDY = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
PROMPTS = ["Write a poem about tides", "List five uses of a paperclip."]


@pytest.fixture(scope="module")
def auto_engine():
    spec = SpecConfig(pacing=False, type="draft-mtp", draft_model=str(MTP_DRAFT), n_max=3, p_min=0.0)
    return Engine.load(EngineConfig(model="default", dtype="auto", activations="f32", ctx_size=2 * 1024, parallel=2,
                                    spec=spec))


@pytest.fixture(scope="module")
def f32_logits(default_engine):
    """The f32 path's next-token logits after `ids`: the reference of the exact-token rule."""
    model, c = default_engine.model, default_engine.model.config

    @torch.inference_mode()
    def logits(ids: list[int]) -> torch.Tensor:
        cache = KVCache(c.num_layers, 1, len(ids), c.num_kv_heads, c.head_dim)
        return model.logits(model(ForwardBatch.build([Row(0, 0, ids)]), cache))[-1]
    return logits


def test_auto_keeps_the_files_blocks(auto_engine):
    model = auto_engine.model
    assert auto_engine.weight_formats == {"q4_1": 210, "q8_0": 1, "f32": 61}
    assert model.lm_head.weight.dtype == torch.uint8  # the tied embedding reads the same blocks
    assert all(layer.mlp.down_proj.weight.dtype == torch.uint8 for layer in model.layers)
    assert stored_formats(auto_engine.files) == model.weight_formats()  # what validate reports is what loads


def test_logits_equal_the_f32_paths_through_prefill_decode_and_verify(default_engine, auto_engine):
    c = default_engine.model.config
    steps = [
        [Row(0, 0, list(range(200, 240))), Row(1, 0, list(range(300, 337)))],  # prefill: dequantize, then GEMM
        [Row(0, 40, [11]), Row(1, 37, [12])],  # decode, two slots: the whole-layer kernel
        [Row(0, 41, [13, 14, 15, 16]), Row(1, 38, [17])],  # a verify block beside a decode row
    ]
    results = []
    for model in (default_engine.model, auto_engine.model):
        cache = KVCache(c.num_layers, 2, 64, c.num_kv_heads, c.head_dim)
        with torch.inference_mode():
            results.append([model.logits(model(ForwardBatch.build(rows), cache)) for rows in steps])
    for f32, auto in zip(*results):
        assert (auto - f32).abs().max() <= RELATIVE * f32.abs().max()


def test_greedy_in_two_slots_with_the_mtp_draft_equals_f32_greedy(default_engine, auto_engine, f32_logits):
    prompts = [chat_ids(default_engine, p) for p in PROMPTS]
    plain = [run_alone(default_engine, ids, GREEDY) for ids in prompts]
    together = run_together(auto_engine, prompts, GREEDY)
    for ids, expected, got in zip(prompts, plain, together):
        assert len(got) == len(expected) == 48
        assert_same_greedy(got, expected, ids, f32_logits)
    assert sum(auto_engine.stats.accepted_at) > 0, "no draft was accepted: verification never ran"


@pytest.mark.skipif(not cpu.has_q8_activations(), reason="the host lacks AVX-512 VNNI and AVX2: auto takes f32 (tested above)")
def test_with_8_bit_activations_two_drafting_slots_give_the_tokens_of_one_plain_request():
    spec = SpecConfig(pacing=False, type="draft-mtp", draft_model=str(MTP_DRAFT), n_max=3, p_min=0.0)
    drafting = Engine.load(EngineConfig(model="default", dtype="auto", activations="q8", ctx_size=2 * 1024,
                                        parallel=2, spec=spec))
    plain = Engine.load(EngineConfig(model="default", dtype="auto", ctx_size=1024))
    assert drafting.activations == plain.activations == "q8"  # auto chose the 8-bit path here
    prompts = [chat_ids(plain, p) for p in PROMPTS]
    alone = [run_alone(plain, ids, GREEDY) for ids in prompts]
    assert run_together(drafting, prompts, GREEDY) == alone
    assert sum(drafting.stats.accepted_at) > 0, "no draft was accepted: verification never ran"


def test_8_bit_activations_are_refused_where_they_cannot_apply():
    with pytest.raises(ConfigError, match="activations='q8': 8-bit activations multiply block weights"):
        EngineConfig(model="default", dtype="f32", activations="q8")
    with pytest.raises(ConfigError, match="activations='q4': must be one of auto, f32, q8"):
        EngineConfig(model="default", dtype="auto", activations="q4")
