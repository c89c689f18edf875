"""A Qwen3.5 GGUF file (llama.cpp's converter's, tests/fixtures/qwen3_5) served through HTTP with the
model's own MTP layer as the draft, in chains: with the main command's defaults (4 slots sharing a
pool, the file's own formats, streaming, pacing), two chats at once and an answer held to a JSON
schema give the greedy tokens of the model without speculation, by the exact-token rule; a second
chat turn resumes the first's prefix from its snapshot and answers as a cold run; and the shape
composes with the draft from the MTP-only file, -pp 2, n-gram continuations and the draft on its own
rank."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from engine.engine import Engine
from engine.sched.sampling import SamplingParams
from engine.settings import EngineConfig
from tests.engine.runs import run_all
from tests.engine.test_generation import chat_ids
from tests.engine.test_qwen3_5_gguf import MODEL, MTP_ONLY
from tests.exact_tokens import assert_same_greedy, next_token_logits, under_grammar
from tests.server.helpers import sse_events
from tests.server.test_combinations import DRAFT_EVERY_STEP, GRAMMAR, SCHEMA, SCHEMA_TOKENS

TOKENS = 24
PROMPTS = ["Tell me about the tide that comes in twice a day.", "Describe a lantern in the harbour master's window."]
DRAFT = ["--spec-type", "draft-mtp", "--spec-draft-p-min", "0"]
CELLS = {
    # The main command's slots (4 sharing a pool), formats, streaming and pacing; both chats draft.
    "main defaults, the model's own MTP layer": [*DRAFT, "--spec-max-batch", "0"],
    "the MTP-only file as -md, -pp 2, 2 slots": [*DRAFT, *DRAFT_EVERY_STEP, "-md", str(MTP_ONLY), "-pp", "2",
                                                 "-np", "2"],
    "n-gram continuations beside it, the draft on its own rank": [
        "--spec-type", "draft-mtp-ngram", "--spec-draft-p-min", "0", *DRAFT_EVERY_STEP, "--spec-draft-rank", "-np", "2"],
}


@pytest.fixture(scope="module")
def plain():
    """The model without speculation, one slot, in this process: each prompt's chat ids, greedy
    answer and the answer held to the schema, and the logits the exact-token rule reads."""
    engine = Engine.load(EngineConfig(model=str(MODEL), dtype="auto", ctx_size=1024))
    ids = [chat_ids(engine, p) for p in PROMPTS]
    answers = [r.output_ids for r in run_all(engine, ids, SamplingParams(temperature=0, max_tokens=TOKENS,
                                                                          ignore_eos=True))]
    [held] = run_all(engine, ids[:1], SamplingParams(temperature=0, max_tokens=SCHEMA_TOKENS), grammar=GRAMMAR)
    logits = next_token_logits(engine.model)
    return ids, answers, logits, held.output_ids, under_grammar(logits, lambda: engine.grammars.constraint(GRAMMAR),
                                                                len(ids[0]))


def chat(client, messages, **fields) -> dict:
    body = {"messages": messages, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "logprobs": True,
            **fields}
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def two_chats_and_a_stream(c) -> tuple[list[dict], str]:
    """PROMPTS' greedy answers, asked at once, and the second one's streamed."""
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda p: chat(c, [{"role": "user", "content": p}], cache_prompt=False), PROMPTS))
    body = {"messages": [{"role": "user", "content": PROMPTS[1]}], "max_tokens": TOKENS, "temperature": 0,
            "ignore_eos": True, "cache_prompt": False, "stream": True}
    with c.stream("POST", "/v1/chat/completions", json=body) as r:
        streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in sse_events(r) if e.get("choices"))
    return answers, streamed


def ids_of(answer: dict) -> list[int]:
    return [entry["id"] for entry in answer["choices"][0]["logprobs"]["content"]]


@pytest.mark.parametrize("cell", CELLS)
def test_greedy_answers_with_the_mtp_draft_are_the_models_own(start_server, plain, cell):
    ids, expected, logits, held_expected, held_logits = plain
    server = start_server(["-m", str(MODEL), "-c", "1024", *CELLS[cell]])
    try:
        with server.client() as c:
            answers, streamed = two_chats_and_a_stream(c)
            held = chat(c, [{"role": "user", "content": PROMPTS[0]}], max_tokens=SCHEMA_TOKENS, ignore_eos=False,
                        response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": SCHEMA}})
            props = c.get("/props").json()
    finally:
        server.kill()
    assert streamed == answers[1]["choices"][0]["message"]["content"]
    for answer, prompt_ids, want in zip(answers, ids, expected):
        assert_same_greedy(ids_of(answer), want, prompt_ids, logits)
        assert answer["timings"]["draft_n"] > 0 and answer["timings"]["draft_n_accepted"] > 0
    assert_same_greedy(ids_of(held), held_expected, ids[0], held_logits)
    assert held["choices"][0]["finish_reason"] == "stop"
    assert props["speculative"]["type"] == CELLS[cell][CELLS[cell].index("--spec-type") + 1]
    assert props["layer_types"] == ["linear_attention", "full_attention"] * 2


def test_a_second_turn_streams_from_the_first_turns_snapshot_as_a_cold_run_answers(start_server):
    server = start_server(["-m", str(MODEL), "-c", "1024", *DRAFT])
    try:
        with server.client() as c:
            first = [{"role": "user", "content": PROMPTS[0]}]
            answer = chat(c, first)["choices"][0]["message"]["content"]
            second = first + [{"role": "assistant", "content": answer}, {"role": "user", "content": PROMPTS[1]}]
            body = {"messages": second, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
            with c.stream("POST", "/v1/chat/completions", json=body) as r:
                events = list(sse_events(r))
            cold = chat(c, second, cache_prompt=False)
            slots = c.get("/slots").json()
    finally:
        server.kill()
    streamed = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e.get("choices"))
    timings = events[-1]["timings"]
    assert timings["cache_n"] > 0, "the second turn computed the first again"
    assert streamed == cold["choices"][0]["message"]["content"]
    assert cold["timings"]["cache_n"] == 0 and timings["prompt_n"] < cold["timings"]["prompt_n"]
    assert len(slots) == 4 and all(s["n_ctx"] == 1024 for s in slots)
    # The slot that served it keeps a snapshot where its prompt ended, for a third turn (or a retry).
    assert any(timings["cache_n"] + timings["prompt_n"] in s["state_snapshots"] for s in slots)
