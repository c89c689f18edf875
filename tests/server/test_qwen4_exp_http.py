"""A tiny Qwen4-Exp checkpoint (configs/tiny/qwen4_exp.json: experts, residual streams, n-gram
embeddings, its QSA indexer with a budget of 2 blocks of 4, so that answers run past it, and its
own MTP layer) served through HTTP: two chats at once and a streamed one give the model's own greedy
tokens, by the exact-token rule, with its MTP layer drafting (a dense layer beside the QSA trunk;
every rejected draft rolls back the recurrent, n-gram and indexer state): with the main command's
defaults (4 slots sharing a pool, pacing), and split over two processes (-pp 2) with the draft on a
rank of its own, read from an MTP-only GGUF (-md); and with the model itself as a draft model (every
draft kept)."""
from __future__ import annotations

import pytest

from engine.cli.tiny import tiny_config, write_tiny_model
from engine.engine import Engine
from engine.sched.sampling import SamplingParams
from engine.settings import EngineConfig
from tests.engine.runs import run_all
from tests.engine.test_qwen4_exp_gguf import MODEL, mtp_only_gguf
from tests.engine.test_generation import chat_ids
from tests.exact_tokens import assert_same_greedy, next_token_logits
from tests.server.test_combinations import DRAFT_EVERY_STEP
from tests.server.test_qwen3_5_http import PROMPTS, TOKENS, ids_of, two_chats_and_a_stream

# --spec-max-batch 0: both chats decode at once, and past one decoding request the default stops drafting
MTP = ["--spec-type", "draft-mtp", "--spec-draft-p-min", "0", "--spec-max-batch", "0"]
CELLS = {
    "main defaults, its own MTP layer": MTP,
    "-pp 2, the MTP layer from its own GGUF on its own rank, 2 slots": [
        "--spec-type", "draft-mtp", *DRAFT_EVERY_STEP, "-pp", "2", "--spec-draft-rank", "-np", "2"],
    "the model as its own draft model, 2 slots": ["--spec-type", "draft", *DRAFT_EVERY_STEP, "-np", "2"],
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_model(tiny_config("qwen4_exp"), tmp_path_factory.mktemp("qwen4_exp"), seed=0)


@pytest.fixture(scope="module")
def plain(model):
    engine = Engine.load(EngineConfig(model=str(model), dtype="auto", ctx_size=1024))
    ids = [chat_ids(engine, p) for p in PROMPTS]
    answers = [r.output_ids for r in run_all(engine, ids, SamplingParams(temperature=0, max_tokens=TOKENS,
                                                                          ignore_eos=True))]
    return ids, answers, next_token_logits(engine.model)


@pytest.mark.parametrize("cell", CELLS)
def test_greedy_answers_are_the_models_own(start_server, model, plain, cell, tmp_path):
    ids, expected, logits = plain
    args = CELLS[cell] + (["-md", str(model)] if "draft model" in cell else
                          ["-md", str(mtp_only_gguf(model, MODEL, tmp_path / "mtp.gguf"))] if "own GGUF" in cell else [])
    server = start_server(["-m", str(model), "-c", "1024", *args])
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
    drafted, kept = (sum(a["timings"][k] for a in answers) for k in ("draft_n", "draft_n_accepted"))
    if "draft model" in cell:
        assert drafted == kept > 0
    else:  # drafts rolled back (a random MTP layer is seldom right on a chat; kept ones: the cell above)
        assert kept < drafted
    assert props["layer_types"] == ["linear_attention", "full_attention"] * 2
