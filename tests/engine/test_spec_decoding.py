"""Speculative decoding is lossless: greedy output with a drafter equals greedy output without one,
and after a rejected draft the cache holds exactly the accepted tokens."""
from __future__ import annotations

import pytest
import torch

from engine.engine import Engine
from engine.model.batch import ForwardBatch, Row
from engine.sched.sampling import SamplingParams
from engine.settings import DEFAULT_DRAFT as MTP_DRAFT
from engine.settings import EngineConfig, SpecConfig
from tests.engine.test_generation import chat_ids, run_alone, run_together
from tests.exact_tokens import assert_same_greedy

PROMPTS = [
    "Write a poem about tides",
    "Describe the city of Paris for a tourist.",
    "Summarise this: the tide comes in, the tide goes out, and the shore keeps every shell the tide leaves.",
]
GREEDY = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)


@pytest.fixture(scope="module")
def ngram_engine():
    spec = SpecConfig(pacing=False, type="ngram-simple", n_max=3, p_min=0.0, ngram_n=2)
    return Engine.load(EngineConfig(model="default", ctx_size=2 * 1024, parallel=2, spec=spec))


@pytest.fixture(scope="module")
def mtp_engine():
    spec = SpecConfig(pacing=False, type="draft-mtp", draft_model=str(MTP_DRAFT), n_max=3, p_min=0.0)
    return Engine.load(EngineConfig(model="default", ctx_size=2 * 1024, parallel=2, spec=spec))


@pytest.fixture(scope="module")
def plain_greedy(default_engine):
    """Each prompt's greedy answer without speculation, computed once for every drafter's test."""
    answers = {}

    def answer(prompt: str) -> tuple[list[int], list[int]]:
        if prompt not in answers:
            ids = chat_ids(default_engine, prompt)
            answers[prompt] = ids, run_alone(default_engine, ids, GREEDY)
        return answers[prompt]
    return answer


@pytest.fixture(scope="module")
def reference_logits(hf_default_model):
    @torch.no_grad()
    def logits(ids):
        return hf_default_model(torch.tensor([ids])).logits[0, -1]
    return logits


@pytest.mark.parametrize("prompt", [PROMPTS[0], PROMPTS[2]])  # PROMPTS[1] runs with trees below
@pytest.mark.parametrize("drafter", ["ngram_engine", "mtp_engine"])
def test_speculative_greedy_equals_plain_greedy(request, plain_greedy, reference_logits, drafter, prompt):
    ids, plain = plain_greedy(prompt)
    steps = list(request.getfixturevalue(drafter).generate(ids, GREEDY, cache_prompt=False))
    speculative = [t for s in steps for t in s.token_ids]
    assert len(speculative) == len(plain) == GREEDY.max_tokens
    assert_same_greedy(speculative, plain, ids, reference_logits)
    assert steps[-1].request.draft_n > 0, "the drafter never proposed anything: nothing was verified"


def test_slots_that_draft_trees_of_different_depths_keep_their_own_drafts(plain_greedy, reference_logits):
    # p_min 0.5, the server's default: each step some slots stop drafting early (an unsure draft)
    # while others go on, so each depth drafts for a different set of slots. Each depth's token has
    # up to two siblings, so the verify rows are trees: a kept sibling's K/V moves down to its place.
    spec = SpecConfig(pacing=False, type="draft-mtp", draft_model=str(MTP_DRAFT), n_max=3, p_min=0.5, width=3, p_sibling=0.05)
    engine = Engine.load(EngineConfig(model="default", ctx_size=3 * 1024, parallel=3, spec=spec))
    prompts = PROMPTS
    together = run_together(engine, [plain_greedy(p)[0] for p in prompts], GREEDY)
    for prompt, speculative in zip(prompts, together):
        ids, plain = plain_greedy(prompt)
        assert len(speculative) == len(plain) == GREEDY.max_tokens
        assert_same_greedy(speculative, plain, ids, reference_logits)
    drafted, accepted = engine.stats.drafted_at, engine.stats.accepted_at
    assert sum(drafted) > sum(accepted) > 0
    assert drafted[0] > drafted[2], "no draft stopped early: p_min never split the slots"
    assert engine.stats.siblings_kept > 0, "no sibling was ever kept: the trees were never tested"


def test_rejected_drafts_leave_exactly_the_accepted_tokens_in_the_cache(ngram_engine):
    ids = chat_ids(ngram_engine, PROMPTS[2])
    steps = list(ngram_engine.generate(ids, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True),
                                       cache_prompt=False))
    req = steps[-1].request
    assert req.draft_n > req.draft_n_accepted > 0, "the run must include both accepted and rejected drafts"
    n = req.num_computed
    text = req.token_ids[:n]
    assert ngram_engine.scheduler.slots[req.slot].cached_ids == text
    # A fresh prefill of the same text into the other slot: the caches and the next logits agree.
    other = 1 - req.slot
    model, cache = ngram_engine.model, ngram_engine.cache
    model(ForwardBatch.build([Row(other, 0, text)]), cache)
    for layer in range(model.config.num_layers):
        keys_spec, values_spec = cache.read(layer, req.slot, n)
        keys_fresh, values_fresh = cache.read(layer, other, n)
        assert torch.allclose(keys_spec, keys_fresh, atol=1e-4)
        assert torch.allclose(values_spec, values_fresh, atol=1e-4)
    next_token = req.output_ids[-1]  # any token will do: both slots must continue alike
    logits = [model.logits(model(ForwardBatch.build([Row(slot, n, [next_token])]), cache))[0]
              for slot in (req.slot, other)]
    assert torch.allclose(logits[0], logits[1], atol=1e-4)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from engine.cli.tiny import tiny_config, write_tiny_model
    config = tiny_config()
    return write_tiny_model(config, tmp_path_factory.mktemp("tiny-draft"), seed=0)


def test_draft_model_greedy_equals_plain_greedy(tiny_dir):
    # The target drafting for itself: every draft must be accepted, and the output unchanged.
    plain = Engine.load(EngineConfig(model=str(tiny_dir), ctx_size=512))
    spec = SpecConfig(pacing=False, type="draft-simple", draft_model=str(tiny_dir), n_max=3, p_min=0.0)
    drafted = Engine.load(EngineConfig(model=str(tiny_dir), ctx_size=512, spec=spec))
    ids = plain.tokenizer.encode("the tide comes in and the tide goes out")
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    expected = [t for s in plain.generate(ids, params) for t in s.token_ids]
    steps = list(drafted.generate(ids, params))
    assert [t for s in steps for t in s.token_ids] == expected
    req = steps[-1].request
    assert req.draft_n > 0 and req.draft_n_accepted == req.draft_n


def test_sampling_with_a_draft_stays_reproducible_per_seed(tiny_dir):
    spec = SpecConfig(pacing=False, type="draft-simple", draft_model=str(tiny_dir), n_max=3, p_min=0.0)
    drafted = Engine.load(EngineConfig(model=str(tiny_dir), ctx_size=512, spec=spec))
    ids = drafted.tokenizer.encode("once upon a time")
    params = SamplingParams(temperature=0.8, seed=5, max_tokens=30, ignore_eos=True)
    runs = [[t for s in drafted.generate(ids, params, cache_prompt=False) for t in s.token_ids] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 30


class ScriptedPacer:
    """A pacer that drafts 3 steps, then pauses 4, whatever the times: drafting stops and resumes
    mid-answer, the MTP draft catching up on the paused positions when it does."""

    def __init__(self):
        self.calls = 0

    def observe(self, request, context, seconds, drafted, tokens):
        pass

    def forget(self, request):
        pass

    def wants_draft(self, request, context, alone) -> bool:
        self.calls += 1
        return self.calls % 7 < 3


def test_a_request_whose_drafting_pauses_and_resumes_keeps_plain_greedy(monkeypatch, plain_greedy, reference_logits):
    monkeypatch.setattr("engine.spec.runner.Pacer", ScriptedPacer)
    spec = SpecConfig(type="draft-mtp", draft_model=str(MTP_DRAFT), n_max=3, p_min=0.0)  # pacing on, the default
    engine = Engine.load(EngineConfig(model="default", ctx_size=1024, parallel=1, spec=spec))
    ids, plain = plain_greedy(PROMPTS[0])
    steps = list(engine.generate(ids, GREEDY, cache_prompt=False))
    assert_same_greedy([t for s in steps for t in s.token_ids], plain, ids, reference_logits)
    request = steps[-1].request
    # Some steps verified drafts and some did not (an unpaced run drafts at every step).
    assert 0 < request.draft_n < 3 * len(steps)
    assert any(len(s.token_ids) == 1 for s in steps[1:])
