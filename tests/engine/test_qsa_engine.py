"""A model with QSA layers served by the engine: speculation stays lossless past the budget (a
rejected draft's positions are rewritten, and their pooled keys with them), and the unified pool
and the q8_0 cache give the per-slot f32 cache's greedy tokens."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.cli.tiny import tiny_config, write_tiny_model
from engine.engine import Engine
from engine.files.weights import open_model
from engine.model import mtp
from engine.sched.sampling import SamplingParams
from engine.settings import CompressRatios, EngineConfig, SpecConfig
from tests.engine.runs import run_all
from tests.engine.test_mtp import save_draft
from tests.exact_tokens import assert_same_greedy, next_token_logits

EVERY4 = CompressRatios.parse("every4:4")
NOISE = 0.5  # of each tensor's spread: the noisy draft's
GREEDY = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)


def write_llama8_with_drafts(folder: Path) -> Path:
    """An eight-layer tiny Llama in `folder`, with two untrained MTP drafts for it (most of their
    drafts are rejected): draft.safetensors (a dense layer) and qsa-draft.safetensors (QSA r=4); and
    noisy/, a draft model (draft-simple) that is the target with noise on every weight, whose top-1
    token is often the target's and, when not, often its second or third: a draft whose trees keep
    siblings."""
    config = tiny_config("llama", num_hidden_layers=8)
    path = write_tiny_model(config, folder, seed=0)
    files = open_model(path)
    tensors = files.load_tensors()
    fingerprint = mtp.target_fingerprint(files.config, tensors["model.embed_tokens.weight"])
    draft = save_draft(path / "draft.safetensors", files.config, tensors, fingerprint)
    mtp.save(path / "qsa-draft.safetensors", draft, num_layers=1, fingerprint=fingerprint, target_name="tiny",
             compress_ratios=(4,))
    noisy = write_tiny_model(config, path / "noisy", seed=0)
    generator = torch.Generator().manual_seed(1)
    save_file({name: t + NOISE * t.std() * torch.randn(t.shape, generator=generator) for name, t in tensors.items()},
              str(noisy / "model.safetensors"), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = write_llama8_with_drafts(tmp_path_factory.mktemp("llama8"))
    return path, path / "draft.safetensors", path / "qsa-draft.safetensors"


PROMPTS = [[(7 * i + j) % 300 + 10 for j in range(30 + 9 * i)] for i in range(2)]  # 30 and 39 tokens, budget 8


SHAPES = {"dense draft": {}, "qsa draft": {},
          # Trees of siblings: a kept sibling's K/V moves down, and the pooled key of its block with it.
          "noisy draft, trees": dict(width=3), "noisy draft, trees, unified q8_0 cache": dict(width=3, q8_unified=True)}


@pytest.mark.parametrize("drafter", list(SHAPES))
def test_speculative_greedy_with_qsa_equals_plain_greedy_past_the_budget(target, drafter):
    path, dense_draft, qsa_draft = target
    shape = dict(SHAPES[drafter])
    cache = dict(kv_unified=True, ctx_size=512, cache_type="q8_0") if shape.pop("q8_unified", False) else {}
    base = {"model": str(path), "ctx_size": 256, "parallel": 2, "compress_ratios": EVERY4, "qsa_budget": 8, **cache}
    plain = Engine.load(EngineConfig(**base))
    draft = {"dense draft": ("draft-mtp", dense_draft), "qsa draft": ("draft-mtp", qsa_draft)}.get(
        drafter, ("draft-simple", path / "noisy"))
    spec = SpecConfig(pacing=False, type=draft[0], draft_model=str(draft[1]), n_max=3, p_min=0.0, p_sibling=0.0,
                      **shape)
    speculative = Engine.load(EngineConfig(**base, spec=spec))
    if drafter == "qsa draft":
        assert speculative.drafter.cache.kpool[0] is not None
    expected = [r.output_ids for r in run_all(plain, PROMPTS, GREEDY)]
    got = run_all(speculative, PROMPTS, GREEDY)
    assert [r.output_ids for r in got] == expected
    assert sum(r.draft_n - r.draft_n_accepted for r in got) > 0, "no draft was rejected: nothing was rewritten"
    if "trees" in drafter:
        assert speculative.stats.siblings_kept > 0, "no sibling was kept: no move was tested"


@pytest.fixture(scope="module")
def default_qsa():
    return Engine.load(EngineConfig(model="default", ctx_size=512, parallel=1, compress_ratios=EVERY4,
                                    qsa_budget=64))


@pytest.mark.parametrize("variant", [dict(kv_unified=True, parallel=2, ctx_size=1024), dict(cache_type="q8_0")])
def test_unified_and_q8_caches_with_qsa_give_the_per_slot_f32_greedy_tokens(default_qsa, variant):
    other = Engine.load(EngineConfig(**{"model": "default", "ctx_size": 512, "parallel": 1,
                                        "compress_ratios": EVERY4, "qsa_budget": 64, **variant}))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    text = "The history of the lighthouse begins with fires on hills. " * 12  # past the budget of 64 positions
    ids = default_qsa.tokenizer.encode(text)
    assert len(ids) > 2 * 64
    expected = run_all(default_qsa, [ids], params)[0].output_ids
    assert_same_greedy(run_all(other, [ids], params)[0].output_ids, expected, ids,
                       next_token_logits(default_qsa.model))


def test_pool_inputs_are_built_for_qsa_layers_only_beside_a_dense_draft(target, monkeypatch):
    """Selection is computed from a layer's own spec: with QSA trunk layers 3 and 7 beside a dense
    MTP draft layer, every call is a QSA layer's, and the draft's cache owns no pool."""
    import engine.model.qsa
    path, dense_draft, _ = target
    spec = SpecConfig(pacing=False, type="draft-mtp", draft_model=str(dense_draft), n_max=3, p_min=0.0)
    eng = Engine.load(EngineConfig(model=str(path), ctx_size=256, parallel=2, compress_ratios=EVERY4, qsa_budget=8,
                                   spec=spec))
    seen = []
    real = engine.model.qsa.allowed

    def allowed(scores, positions, length, ratio, keep, base=None):
        seen.append(ratio)
        return real(scores, positions, length, ratio, keep, base)
    monkeypatch.setattr(engine.model.qsa, "allowed", allowed)
    run_all(eng, PROMPTS, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert seen and set(seen) == {4}
    assert [i for i, pool in enumerate(eng.cache.kpool) if pool is not None] == [3, 7]
    assert eng.drafter.cache.kpool == [None]
    assert eng.drafter.model.layers[0].block.self_attn.spec.kind == "dense"
