"""One request's failure is its own: an exception while sampling, verifying or drafting for one
request fails that request alone, a failed forward fails only that step's requests, and the engine
keeps serving."""
from __future__ import annotations

import pytest

import engine.engine
import engine.spec.ngram
from engine.engine import Engine
from engine.sched.sampling import SamplingParams
from engine.settings import EngineConfig, SpecConfig
from tests.engine.runs import run_all

PARAMS = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
POISON = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, seed=13)  # the one that fails


@pytest.fixture(scope="module")
def engines(tiny_model):
    plain = Engine.load(EngineConfig(model=str(tiny_model), ctx_size=512, parallel=2))
    spec = SpecConfig(pacing=False, type="ngram-simple", n_max=3, p_min=0.0, ngram_n=1)
    ngram = Engine.load(EngineConfig(model=str(tiny_model), ctx_size=512, parallel=2, spec=spec))
    return plain, ngram


PROMPTS = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8, 9]]


def test_an_exception_sampling_one_request_fails_it_alone(engines, monkeypatch):
    plain, _ = engines
    alone = run_all(plain, PROMPTS[:1], [PARAMS])[0].output_ids
    real = engine.engine.choose

    def choose(logits, params, history, generator, constraint):
        if params.seed == 13:
            raise RuntimeError("poisoned")
        return real(logits, params, history, generator, constraint)
    monkeypatch.setattr(engine.engine, "choose", choose)
    good, bad = run_all(plain, PROMPTS, [PARAMS, POISON])
    assert bad.finish_reason == "error" and good.finish_reason == "length" and good.output_ids == alone


def test_an_exception_drafting_for_one_request_fails_it_alone(engines, monkeypatch):
    _, ngram = engines
    alone = run_all(ngram, PROMPTS[:1], [PARAMS])[0].output_ids
    real = engine.spec.ngram.ngram_draft

    def ngram_draft(ids, n, limit):
        if ids[:len(PROMPTS[1])] == PROMPTS[1]:
            raise RuntimeError("poisoned")
        return real(ids, n, limit)
    monkeypatch.setattr(engine.spec.ngram, "ngram_draft", ngram_draft)
    good, bad = run_all(ngram, PROMPTS, [PARAMS, PARAMS])
    assert bad.finish_reason == "error" and good.finish_reason == "length" and good.output_ids == alone
    assert good.draft_n > 0


def test_a_failed_forward_fails_its_step_and_the_engine_serves_on(engines, monkeypatch):
    plain, _ = engines
    real = plain.model.forward
    calls = {"n": 0}

    def forward(batch, cache):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device lost")
        return real(batch, cache)
    monkeypatch.setattr(plain.model, "forward", forward)
    first = run_all(plain, PROMPTS, [PARAMS, PARAMS])
    assert [r.finish_reason for r in first] == ["error", "error"]
    again = run_all(plain, PROMPTS[:1], [PARAMS])[0]
    assert again.finish_reason == "length" and len(again.output_ids) == 30
