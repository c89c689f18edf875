"""A tiny Qwen4-Exp checkpoint (configs/tiny/qwen4_exp.json: experts, residual streams, n-gram
embeddings and its QSA indexer with a budget of 2 blocks of 4, so that answers run past it) served
through HTTP: two chats at once and a streamed one give the model's own greedy tokens, by the
exact-token rule: with the main command's defaults (4 slots sharing a pool, pacing) and the model
drafting for itself (every draft accepted), and split over two processes (-pp 2) with a draft model
whose drafts are rejected (every rejection rolls back the recurrent, n-gram and indexer state)."""
from __future__ import annotations

import pytest

from engine.cli.tiny import tiny_config, write_tiny_model
from engine.engine import Engine
from engine.sched.sampling import SamplingParams
from engine.settings import EngineConfig
from tests.engine.runs import run_all
from tests.engine.test_generation import chat_ids
from tests.exact_tokens import assert_same_greedy, next_token_logits
from tests.server.test_qwen3_5_http import PROMPTS, TOKENS, ids_of, two_chats_and_a_stream

DRAFT = ["--spec-type", "draft", "--spec-draft-p-min", "0"]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The target, and another seed's model as a draft that is nearly always wrong."""
    return [write_tiny_model(tiny_config("qwen4_exp"), tmp_path_factory.mktemp(f"qwen4_exp_{seed}"), seed)
            for seed in (0, 1)]


@pytest.fixture(scope="module")
def plain(models):
    engine = Engine.load(EngineConfig(model=str(models[0]), dtype="auto", ctx_size=1024))
    ids = [chat_ids(engine, p) for p in PROMPTS]
    answers = [r.output_ids for r in run_all(engine, ids, SamplingParams(temperature=0, max_tokens=TOKENS,
                                                                          ignore_eos=True))]
    return ids, answers, next_token_logits(engine.model)


@pytest.mark.parametrize("cell", ["main defaults, the model drafting for itself",
                                  "-pp 2, 2 slots, a draft model that is wrong"])
def test_greedy_answers_are_the_models_own(start_server, models, plain, cell):
    ids, expected, logits = plain
    target, other = models
    args = [*DRAFT, "-md", str(target), "--spec-max-batch", "0"] if cell.startswith("main") else \
        [*DRAFT, "-md", str(other), "--no-spec-pacing", "--spec-max-batch", "0", "-pp", "2", "-np", "2"]
    server = start_server(["-m", str(target), "-c", "1024", *args])
    try:
        with server.client() as c:
            answers, streamed = two_chats_and_a_stream(c)
            props = c.get("/props").json()
    finally:
        server.kill()
    assert streamed == answers[1]["choices"][0]["message"]["content"]
    for answer, prompt_ids, want in zip(answers, ids, expected):
        assert len(prompt_ids) + TOKENS > 4 * 3, "the answers must run past the QSA budget"
        assert_same_greedy(ids_of(answer), want, prompt_ids, logits)
        timings = answer["timings"]
        assert timings["draft_n"] > 0
        if cell.startswith("main"):
            assert timings["draft_n_accepted"] == timings["draft_n"]
        else:
            assert timings["draft_n_accepted"] < timings["draft_n"]
    assert props["layer_types"] == ["linear_attention", "full_attention"] * 2
