"""Answers held to a schema or grammar through HTTP, on the main command's defaults (the default
model's own weights, MTP drafts, 4 slots) but drafting at every step (--no-spec-pacing: pacing
pauses drafts where they do not pay on the host, and these tests hold the drafts to the grammar):
OpenAI's response_format on chat and text completions,
llama-server's json_schema and grammar fields and its native /completion; with speculation the
greedy tokens are those of the same request drafting nothing; a grammar that cannot be used is a
400 naming the field before a slot is taken."""
from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest

from tests.exact_tokens import NEAR_TIE, first_difference
from tests.server.helpers import sse_events, wait_idle

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "born": {"type": "integer", "minimum": 1800, "maximum": 2000},
        "field": {"enum": ["mathematics", "physics", "chemistry", "poetry"]},
        "works": {"type": "array", "items": {"type": "string", "maxLength": 40}, "minItems": 1, "maxItems": 3},
        "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                  "country": {"type": "string", "maxLength": 30}},
                 "required": ["city", "country"]},
    },
    "required": ["name", "born", "field", "works", "home"],
}
ASK = [{"role": "user", "content": "Describe the scientist Marie Curie as a JSON record."}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}


@pytest.fixture(scope="module")
def client(start_server):
    server = start_server(["-m", "default", "--no-spec-pacing"])
    try:
        with server.client() as c:
            yield c
    finally:
        server.kill()


def chat(client, **body) -> dict:
    r = client.post("/v1/chat/completions", json={"messages": ASK, "temperature": 0, "max_tokens": 200, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_a_json_schema_answer_validates_whole_and_streamed(client):
    whole = chat(client, response_format=FORMAT)
    choice = whole["choices"][0]
    answer = json.loads(choice["message"]["content"])
    jsonschema.validate(answer, PERSON)
    assert list(answer) == list(PERSON["properties"]), "the keys come in the schema's order"
    assert choice["finish_reason"] == "stop"
    with client.stream("POST", "/v1/chat/completions", json={"messages": ASK, "temperature": 0, "max_tokens": 200,
                                                             "stream": True, "response_format": FORMAT}) as r:
        events = list(sse_events(r))
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"])
    assert text == choice["message"]["content"]
    assert whole["timings"]["draft_n"] > 0, "the main command drafts: the grammar met speculation"
    props = client.get("/props").json()
    assert props["constrained_decoding"]["response_format"] == ["text", "json_object", "json_schema"]
    assert props["tools"] == {"call_format": "hermes", "template_renders_tools": False,  # SmolLM2-135M's template
                              "tool_choice": ["none", "auto", "required", "function"]}


def test_greedy_under_a_schema_with_drafts_gives_the_tokens_of_the_same_request_drafting_nothing(client):
    body = {"response_format": FORMAT, "logprobs": True, "top_logprobs": 5}
    drafted, plain = chat(client, **body), chat(client, **body, **{"speculative.n_max": 0})
    assert drafted["timings"]["draft_n"] > 0 and "draft_n" not in plain["timings"]
    assert_same_tokens(*(r["choices"][0]["logprobs"]["content"] for r in (drafted, plain)))


def assert_same_tokens(got: list[dict], ref: list[dict]) -> None:
    """Two greedy answers' logprobs entries agree by the exact-token rule: identical, or first
    different where the two tokens were tied at the reference's row (its top_logprobs)."""
    i = first_difference([e["id"] for e in got], [e["id"] for e in ref])
    if i is not None:
        assert i < min(len(got), len(ref))
        top = {t["id"]: t["logprob"] for t in ref[i]["top_logprobs"]}
        assert got[i]["id"] in top and abs(top[got[i]["id"]] - top[ref[i]["id"]]) < NEAR_TIE, (i, got[i], ref[i])


def test_a_schema_request_beside_a_plain_stream_leaves_the_stream_as_it_was_alone(client):
    # Both streams evaluate the whole prompt: a cached prefix would have the second's last prompt rows
    # attend it apart from themselves (merged by log-sum-exp), rounding apart from one causal call,
    # and 8-bit activations carry such roundings to logprobs hundredths apart (a greedy token can
    # change, as it did on a Zen 4 host). What this test holds is the batch leaving the stream alone.
    plain = {"messages": [{"role": "user", "content": "Write about lighthouses on a stormy coast."}],
             "temperature": 0, "max_tokens": 64, "ignore_eos": True, "logprobs": True, "top_logprobs": 5,
             "cache_prompt": False}

    def streamed() -> list[dict]:
        with client.stream("POST", "/v1/chat/completions", json={**plain, "stream": True}) as r:
            return [e for chunk in sse_events(r) if chunk["choices"] and chunk["choices"][0]["logprobs"]
                    for e in chunk["choices"][0]["logprobs"]["content"]]

    alone = streamed()
    with ThreadPoolExecutor(2) as pool:
        held = pool.submit(chat, client, response_format=FORMAT, max_tokens=200)
        beside = pool.submit(streamed)
        jsonschema.validate(json.loads(held.result()["choices"][0]["message"]["content"]), PERSON)
        assert len(beside.result()) == len(alone) == 64
    assert_same_tokens(beside.result(), alone)


def test_json_object_on_text_completions_and_llama_servers_json_schema_field(client):
    r = client.post("/v1/completions", json={"prompt": "A JSON object with the name and age of a cat: ", "temperature": 0,
                                             "max_tokens": 120, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    assert isinstance(json.loads(r.json()["choices"][0]["text"]), dict)
    small = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Is water wet?"}],
                                                  "temperature": 0, "max_tokens": 40, "json_schema": small})
    jsonschema.validate(json.loads(r.json()["choices"][0]["message"]["content"]), small)


def test_llama_servers_completion_endpoint_with_a_gbnf_grammar_whole_and_streamed(client):
    body = {"prompt": "Is the sky blue? Answer:", "n_predict": 16, "temperature": 0, "n_probs": 2,
            "grammar": 'root ::= " " ("yes" | "no") "."'}
    r = client.post("/completion", json=body)
    assert r.status_code == 200, r.text
    whole = r.json()
    assert whole["content"] in (" yes.", " no.") and whole["stop"] is True and whole["stop_type"] == "eos"
    assert whole["tokens_predicted"] == len(whole["tokens"]) == len(whole["completion_probabilities"])
    assert whole["timings"]["predicted_n"] == whole["tokens_predicted"]
    with client.stream("POST", "/completion", json={**body, "stream": True}) as r:
        lines = list(r.iter_lines())
    events = [json.loads(line[6:]) for line in lines if line.startswith("data: ")]
    assert "".join(e["content"] for e in events) == whole["content"]
    assert [e["stop"] for e in events] == [False] * (len(events) - 1) + [True]
    plain = client.post("/completion", json={"prompt": "The capital of France is", "n_predict": 4,
                                             "temperature": 0}).json()
    assert plain["tokens_predicted"] == 4 and plain["stop_type"] == "limit"


@pytest.mark.parametrize("body, problem", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
     "response_format.json_schema.schema: Invalid type: strng"),
    ({"response_format": {"type": "json_schema"}}, "type 'json_schema' needs a json_schema object"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"grammar": 'root ::= "a" | b'}, "grammar: Rule 'b' not found"),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "json_schema and grammar: give at most one"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                  "function": {"name": "g"}}},
     "tool_choice: function 'g' is not among the tools (f)"),
    ({"tool_choice": "required"}, "tool_choice: calls a tool but no tools are given"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools.0.function.name"),
])
def test_what_cannot_be_used_is_a_400_naming_the_field_before_a_slot_is_taken(client, body, problem):
    before = requests_served(client)
    r = client.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body})
    assert r.status_code == 400 and problem in r.json()["error"]["message"], r.text
    assert requests_served(client) == before, "the refused request reached the engine"


def requests_served(client) -> float:
    wait_idle(client)
    line = next(x for x in client.get("/metrics").text.splitlines() if x.startswith("tandem:requests_total "))
    return float(line.split()[1])
