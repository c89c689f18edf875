"""A Llama 3 GGUF file as llama.cpp's converter writes it (RoPE scaling as `rope_freqs.weight`), split
in parts by llama-gguf-split (tests/fixtures/llama3, remade by its remake.py): tandem opens it by its
first part, reads it as the checkpoint it came from, and gives llama-server's greedy tokens on it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.engine import Engine
from engine.files.weights import open_model
from engine.sched.sampling import SamplingParams
from engine.settings import EngineConfig
from tests.engine.runs import run_all
from tests.engine.test_parity import assert_matches, engine_logits, load_engine_model, one_thread, reference  # noqa: F401
from tests.exact_tokens import assert_same_greedy, next_token_logits

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llama3"
PARTS = sorted(FIXTURES.glob("tiny-llama3-f32-*-of-*.gguf"))
MODEL = PARTS[0]
LLAMA = json.loads((FIXTURES / "llama_server.json").read_text())


def test_the_split_converted_file_reads_as_the_checkpoint_it_came_from(reference):
    ref = reference("rope_llama3")  # the config and seed the fixture was converted from
    files = open_model(MODEL)
    assert len(PARTS) == 3 and files.config.rope.freq_factors
    assert_matches(engine_logits(load_engine_model(MODEL), ref.tokens), ref.logits)


@pytest.fixture(scope="module")
def engine():
    return Engine.load(EngineConfig(model=str(MODEL), dtype="auto", ctx_size=512))


def test_greedy_tokens_equal_llama_servers(engine):
    params = SamplingParams(temperature=0, max_tokens=LLAMA["n_predict"], ignore_eos=True)
    for request, theirs in zip(run_all(engine, LLAMA["prompts"], params), LLAMA["answers"]):
        assert_same_greedy(request.output_ids, theirs["tokens"], request.prompt_ids, next_token_logits(engine.model))
