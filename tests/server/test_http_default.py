"""Greedy output through a real server on the default model (SmolLM2-135M): the official openai
client, concurrent streams against solo runs, and prefix reuse, on a plain f32 server (`--spec-type
none --dtype f32`, two slots); and what `python -m server` serves with no flags: the file's own
Q4_1 blocks (against 8-bit activations where the CPU has VNNI) and the shipped MTP draft on 4 slots
sharing one KV pool, with the plain f32 server's greedy answer.

Token lists are compared with the exact-token rule (docs/architecture.md, "The exact-token rule");
the reference's top-2 logit gap comes from its own top_logprobs (a logprob gap equals the logit gap)."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from engine import cpu
from engine.settings import DEFAULT_DRAFT
from tests.exact_tokens import NEAR_TIE, first_difference
from tests.server.helpers import sse_events

N_TOKENS = 12
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Why is the sky blue?",
             "Write a haiku about rain."]


@pytest.fixture(scope="module")
def server(start_server):
    s = start_server(["-m", "default", "-np", "2", "-c", "4096", "-ub", "128", "--alias", "smollm2", "--spec-type",
                      "none", "--dtype", "f32"], wait=False)
    s.first_health = first_health_answer(s)
    yield s.wait_ready()
    s.kill()


def first_health_answer(server, timeout: float = 60.0) -> httpx.Response | None:
    """The first answer /health gives (the default model takes seconds to load after the HTTP
    server is up, so this is normally the 'Loading model' 503)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and server.proc.poll() is None:
        try:
            return httpx.get(f"{server.url}/health", timeout=5)
        except httpx.TransportError:
            time.sleep(0.05)
    return None


def test_health_answers_503_while_loading_then_ok(server):
    first = server.first_health
    assert first is not None and first.status_code == 503
    assert first.json() == {"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}}
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}


def chat(question: str, system: str | None = None) -> dict:
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return {"messages": messages, "temperature": 0, "max_tokens": N_TOKENS, "logprobs": True, "top_logprobs": 2}


def tokens_of(entries: list[dict]) -> list[int]:
    return [e["id"] for e in entries]


def assert_same_greedy(got: list[dict], ref: list[dict]) -> None:
    """got, ref: chat logprobs entries; ref's top-2 decide whether a difference is a near-tie."""
    a, b = tokens_of(got), tokens_of(ref)
    i = first_difference(a, b)
    if i is None:
        return
    assert i < min(len(a), len(b)), f"one output is a prefix of the other: {a} vs {b}"
    top = ref[i]["top_logprobs"]
    gap = top[0]["logprob"] - top[1]["logprob"]
    assert gap < NEAR_TIE, f"first difference at token {i} ({a[i]} vs {b[i]}) is not a near-tie (gap {gap:.4g})"


def whole(client, body: dict) -> dict:
    r = client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(server, body: dict) -> tuple[list[dict], list[dict]]:
    """(chunks, logprob entries) of one streamed chat completion."""
    with server.client() as c, c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        chunks = list(sse_events(r))
    entries = [e for ch in chunks if ch["choices"] and ch["choices"][0].get("logprobs")
               for e in ch["choices"][0]["logprobs"]["content"]]
    return chunks, entries


def test_openai_client_stream_equals_non_streamed(server):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", timeout=120, max_retries=0)
    kwargs = dict(model="smollm2", messages=[{"role": "user", "content": QUESTIONS[0]}], temperature=0,
                  max_tokens=N_TOKENS)
    full = client.chat.completions.create(**kwargs)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in
                   client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs)
                   if chunk.choices)
    assert full.choices[0].message.content and text == full.choices[0].message.content
    assert full.usage.completion_tokens == full.model_extra["timings"]["predicted_n"]


def test_four_concurrent_streams_on_two_slots_match_solo_runs(server):
    with server.client() as c:
        solo = [whole(c, chat(q)) for q in QUESTIONS]
        with ThreadPoolExecutor(4) as pool:
            together = list(pool.map(lambda q: streamed(server, chat(q)), QUESTIONS))
        busy = c.get("/metrics").text
    for (chunks, entries), ref in zip(together, solo):
        ref_entries = ref["choices"][0]["logprobs"]["content"]
        assert chunks[-1]["choices"][0]["finish_reason"] == ref["choices"][0]["finish_reason"]
        assert_same_greedy(entries, ref_entries)
        if tokens_of(entries) == tokens_of(ref_entries):
            text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks)
            assert text == ref["choices"][0]["message"]["content"]
    per_step = float(next(line.split()[1] for line in busy.splitlines()
                          if line.startswith("tandem:n_busy_slots_per_decode")))
    assert per_step > 1.0  # steps batched both slots


def test_prefix_reuse_reports_cache_n_and_keeps_the_output(server):
    system = "You are a careful assistant. " * 12 + "Answer in one short sentence."
    with server.client() as c:
        whole(c, chat(QUESTIONS[1], system))
        reused = whole(c, chat(QUESTIONS[2], system))
        fresh = whole(c, {**chat(QUESTIONS[2], system), "cache_prompt": False})
    assert reused["timings"]["cache_n"] > 50
    assert fresh["timings"]["cache_n"] == 0
    assert reused["usage"]["prompt_tokens"] == reused["timings"]["cache_n"] + reused["timings"]["prompt_n"]
    assert_same_greedy(reused["choices"][0]["logprobs"]["content"], fresh["choices"][0]["logprobs"]["content"])


def test_spec_type_none_serves_without_a_draft(server):
    with server.client() as c:
        assert c.get("/props").json()["speculative"]["type"] is None
        assert not any(slot["speculative"] for slot in c.get("/slots").json())


def test_the_main_command_serves_the_shipped_draft_on_four_unified_slots(start_server, server):
    product = start_server([])
    try:
        with product.client() as c:
            props = c.get("/props").json()
            slots = c.get("/slots").json()
            got = whole(c, chat(QUESTIONS[3]))
    finally:
        product.kill()
    assert (props["speculative"]["type"], props["speculative"]["draft_model"], props["speculative"]["width"]) == \
        ("draft-mtp-ngram", str(DEFAULT_DRAFT), 1)
    assert (props["dtype"], props["total_slots"], props["kv_unified"]) == ("auto", 4, True)
    assert props["activations"] == ("q8" if cpu.has_q8_activations() else "f32")  # --activations auto
    assert [(s["n_ctx"], s["speculative"]) for s in slots] == [(props["n_ctx"], True)] * 4
    with server.client() as c:
        plain = whole(c, chat(QUESTIONS[3]))
    assert got["timings"]["draft_n"] > 0
    assert_same_greedy(got["choices"][0]["logprobs"]["content"], plain["choices"][0]["logprobs"]["content"])
