"""Speculation over a recurrent model (Qwen3.5, and Qwen4-Exp with its residual streams, n-gram
state and QSA indexer) stays exact: the model's own MTP layer drafts, the target
verifies a block whose rejected suffix is rolled back out of the recurrent state (as a length:
engine/model/recurrent_cache.py), and the tokens that come out follow the target's distribution,
the ones after a rollback included; greedy output equals greedy output without the draft."""
from __future__ import annotations

import collections
import dataclasses
import itertools

import pytest
import torch
from scipy.stats import chisquare

from engine.engine import Engine
from engine.sched.sampling import SamplingParams, distribution
from engine.settings import EngineConfig, SpecConfig
from tests.engine.runs import run_all
from tests.exact_tokens import next_token_logits

PROMPT = [(11 * i + 5) % 250 + 3 for i in range(12)]
DRAWS = 800
DRAFT = SpecConfig(type="draft-mtp", n_max=3, p_min=0.0, pacing=False)


@pytest.fixture(scope="module", params=["qwen3_5", "qwen4_exp"])
def qwen35(tmp_path_factory, request):
    from engine.cli.tiny import tiny_config, write_tiny_model
    return write_tiny_model(tiny_config(request.param), tmp_path_factory.mktemp(request.param), seed=0)


def engine(path, spec: SpecConfig | None, slots: int) -> Engine:
    return Engine.load(EngineConfig(model=str(path), ctx_size=128 * slots, parallel=slots, spec=spec))


def test_sampled_tokens_after_rolled_back_drafts_keep_the_targets_distribution(qwen35):
    # Three sampled tokens from top-3: the second comes from a verify block (kept draft or resampled
    # residual), the third often from the step after a rejection, whose recurrent state must be
    # the one after the kept tokens alone. Their joint law is the target's, computed token by token.
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=3, ignore_eos=True)
    spec = engine(qwen35, DRAFT, slots=8)
    requests = run_all(spec, [PROMPT] * DRAWS, [dataclasses.replace(params, seed=i) for i in range(DRAWS)])
    assert sum(r.draft_n - r.draft_n_accepted for r in requests) > DRAWS // 4, "rollbacks happened"
    logits = next_token_logits(spec.model)
    law = {(): 1.0}
    for depth in range(3):
        law = {path + (y,): p * float(q) for path, p in law.items()
               for y, q in enumerate(distribution(logits(PROMPT + list(path)), params)) if q > 0}
    seen = collections.Counter(tuple(r.output_ids) for r in requests)
    assert set(seen) <= set(law), f"token sequences the target never samples: {set(seen) - set(law)}"
    outcomes = sorted(law)
    observed = torch.tensor([seen[o] for o in outcomes], dtype=torch.float64)
    expected = torch.tensor([law[o] for o in outcomes], dtype=torch.float64)
    assert chisquare(observed.numpy(), (expected / expected.sum() * DRAWS).numpy()).pvalue > 0.001


def test_greedy_with_the_draft_equals_greedy_without_it_in_shared_slots(qwen35):
    prompts = [PROMPT, PROMPT[:5], [40, 41, 42, 43] * 5, list(itertools.islice(itertools.cycle(range(3, 90)), 50))]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = run_all(engine(qwen35, None, slots=1), prompts, params)
    drafted = run_all(engine(qwen35, DRAFT, slots=3), prompts, params)
    assert [r.output_ids for r in drafted] == [r.output_ids for r in plain]
    # Drafts kept and drafts rolled back, across the shared slots.
    assert sum(r.draft_n_accepted for r in drafted) > 0 and any(r.draft_n > r.draft_n_accepted for r in drafted)


@pytest.mark.parametrize("spec", [None, DRAFT], ids=["plain", "draft-mtp"])
def test_a_second_turn_resumes_the_first_from_its_snapshot_and_answers_as_a_cold_run(qwen35, spec):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    warm, cold = engine(qwen35, spec, slots=1), engine(qwen35, spec, slots=1)
    [first] = run_all(warm, [PROMPT], params, cache_prompt=True)
    second = first.token_ids + [7, 8, 9]  # the first turn's prompt and answer, then the next message
    [resumed] = run_all(warm, [second], params, cache_prompt=True)
    [fresh] = run_all(cold, [second], params)
    # The answer's last token was emitted, not computed: all before it comes from the snapshot.
    assert resumed.cache_n == len(first.token_ids) - 1
    assert (resumed.output_ids, resumed.draft_n, resumed.draft_n_accepted) == \
        (fresh.output_ids, fresh.draft_n, fresh.draft_n_accepted)
