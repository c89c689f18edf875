"""HTTP behaviour of a real server process on a tiny random model: endpoints, errors, auth,
stop strings, disconnects. One server is shared by the module."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.helpers import sse_events, wait_idle

KEY = "sekret"
CHAT = {"messages": [{"role": "user", "content": "hello"}], "temperature": 0}


@pytest.fixture(scope="module")
def server(start_server, tiny_model):
    s = start_server(["-m", str(tiny_model), "-np", "2", "-c", "8192", "--alias", "tiny", "--body-limit", "65536"],
                     api_key=KEY)
    yield s
    s.kill()


@pytest.fixture(scope="module")
def client(server):
    with server.client() as c:
        yield c


def assert_error(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["type"] and err["message"]
    for w in words:
        assert w in err["message"], (w, err["message"])


def test_health_needs_no_key_and_everything_else_does(server):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    for path in ("/props", "/slots", "/metrics", "/v1/models"):
        assert_error(httpx.get(f"{server.url}{path}"), 401, "API Key")
    r = httpx.post(f"{server.url}/v1/chat/completions", json=CHAT, headers={"Authorization": "Bearer wrong"})
    assert_error(r, 401)


def test_props_slots_models_report_the_configuration(client):
    props = client.get("/props").json()
    assert props["model_alias"] == "tiny" and props["n_ctx"] == 8192 and props["total_slots"] == 2
    assert props["default_generation_settings"]["n_ctx"] == 4096
    assert {"build_info", "model_path", "speculative"} <= props.keys()
    assert {"type", "n_max", "n_min", "p_min", "draft_model"} <= props["speculative"].keys()
    slots = client.get("/slots").json()
    assert [s["id"] for s in slots] == [0, 1] and all(s["n_ctx"] == 4096 for s in slots)
    assert all("is_processing" in s for s in slots)
    model = client.get("/v1/models").json()["data"][0]
    assert model["id"] == "tiny" and model["context_length"] == 4096


def test_chat_completion_object_and_stream_agree(client):
    body = {**CHAT, "max_tokens": 12, "ignore_eos": True}
    whole = client.post("/v1/chat/completions", json=body).json()
    assert whole["object"] == "chat.completion" and whole["choices"][0]["finish_reason"] == "length"
    assert whole["usage"]["completion_tokens"] == 12 == whole["timings"]["predicted_n"]
    t = whole["timings"]
    assert whole["usage"]["prompt_tokens"] == t["cache_n"] + t["prompt_n"]
    for key in ("prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_ms", "predicted_per_token_ms",
                "predicted_per_second"):
        assert t[key] >= 0
    with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
        chunks = list(sse_events(r))
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["timings"]["predicted_n"] == 12
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks)
    assert text == whole["choices"][0]["message"]["content"]


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", CHAT), ("/v1/completions", {"prompt": "hello"})])
def test_a_stream_carries_usage_only_when_include_usage_asks_as_openais_does(client, path, body):
    body = {**body, "max_tokens": 5, "ignore_eos": True, "stream": True}
    with client.stream("POST", path, json=body) as r:
        plain = list(sse_events(r))
    assert not any("usage" in c for c in plain)
    assert plain[-1]["choices"][0]["finish_reason"] == "length" and plain[-1]["timings"]["predicted_n"] == 5
    with client.stream("POST", path, json={**body, "stream_options": {"include_usage": True}}) as r:
        counted = list(sse_events(r))
    *rest, finish, usage = counted
    assert not any("usage" in c for c in [*rest, finish]) and finish["choices"][0]["finish_reason"] == "length"
    assert usage["choices"] == [] and usage["object"] == finish["object"] and usage["id"] == finish["id"]
    assert usage["usage"]["completion_tokens"] == 5 == usage["timings"]["predicted_n"]
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5


def test_text_completion_accepts_token_ids_and_gives_logprobs(client):
    ids = client.post("/tokenize", json={"content": "abc"}).json()["tokens"]
    assert client.post("/detokenize", json={"tokens": ids}).json()["content"] == "abc"
    r = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 3, "temperature": 0, "logprobs": 2,
                                             "ignore_eos": True}).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["token_logprobs"]) == 3 and all(len(t) <= 2 for t in lp["top_logprobs"])
    by_text = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 3, "temperature": 0,
                                                   "ignore_eos": True}).json()
    assert by_text["choices"][0]["text"] == r["choices"][0]["text"]
    prompt = client.post("/apply-template", json={"messages": CHAT["messages"]}).json()["prompt"]
    assert "hello" in prompt


def test_stop_string_is_never_emitted(client):
    body = {"prompt": "abc", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = full[5:8]  # spans several one-byte tokens of the tiny tokenizer
    expected = full[:full.index(stop)]
    r = client.post("/v1/completions", json={**body, "stop": [stop, "never-there"]}).json()
    assert r["choices"][0]["text"] == expected and r["choices"][0]["finish_reason"] == "stop"
    assert r["usage"]["completion_tokens"] == r["timings"]["predicted_n"]
    with client.stream("POST", "/v1/completions", json={**body, "stop": stop, "stream": True}) as resp:
        chunks = list(sse_events(resp))
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


BAD_INPUTS = [
    ("malformed json", b'{"messages": [', "malformed JSON"),
    ("invalid UTF-8", b'{"messages": [{"role": "user", "content": "\xff"}]}', "body is not valid UTF-8 at byte 43"),
    ("nested too deep", b'{"messages": [{"role": "user", "content": "hi"}], "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",
     "JSON nested deeper than 128 levels"),
    ("wrong type", {**CHAT, "max_tokens": "many"}, "max_tokens"),
    ("unknown role", {"messages": [{"role": "wizard", "content": "hi"}]}, "wizard"),
    ("empty messages", {"messages": []}, "messages"),
    ("missing messages", {"temperature": 0}, "messages"),
    ("prompt too long", {"messages": [{"role": "user", "content": "x" * 5000}]}, "slot context"),
    ("max_tokens too large", {**CHAT, "max_tokens": 5000}, "max_tokens"),
    ("negative temperature", {**CHAT, "temperature": -0.5}, "temperature"),
    ("nan temperature", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', "temperature"),
    ("top_p zero", {**CHAT, "top_p": 0}, "top_p"),
    ("top_p above one", {**CHAT, "top_p": 1.5}, "top_p"),
    ("n above one", {**CHAT, "n": 2}, "n"),
    ("tool choice", {**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "always"},
     "tool_choice: must be"),
    ("response format", {**CHAT, "response_format": {"type": "yaml"}}, "response_format.type"),
    ("five stop strings", {**CHAT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("bad logit bias", {**CHAT, "logit_bias": {"99999": 1}}, "logit_bias"),
    ("bad id_slot", {**CHAT, "id_slot": 7}, "id_slot"),
    ("lone surrogate in a message", b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', "messages.0.content"),
    ("seed too large", {**CHAT, "seed": 2**64}, "seed"),
    ("seed too small", {**CHAT, "seed": -2**63 - 1}, "seed"),
    ("infinite token id", b'{"messages": [{"role": "user", "content": "hi"}], "logit_bias": [[Infinity, 5]]}',
     "logit_bias"),
    ("fractional token id", {**CHAT, "logit_bias": [[1.7, 5]]}, "logit_bias"),
    ("zero repeat_penalty", {**CHAT, "repeat_penalty": 0}, "repeat_penalty=0"),
    ("infinite presence_penalty", b'{"messages": [{"role": "user", "content": "hi"}], "presence_penalty": Infinity}',
     "presence_penalty"),
    ("negative top_k", {**CHAT, "top_k": -1}, "top_k"),
    ("unknown field", {**CHAT, "frobnicate": 1}, "frobnicate: unknown key"),
    ("an engine name for a field", {**CHAT, "repetition_penalty": 1.1}, "repetition_penalty: unknown key"),
    ("a llama-server sampler switched on", {**CHAT, "typical_p": 0.9, "mirostat": 2},
     "typical_p=0.9: not supported by this server (only 1.0, which switches it off); mirostat=2"),
]


@pytest.mark.parametrize("name,body,word", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_gets_a_400_naming_the_problem(client, name, body, word):
    if isinstance(body, bytes):
        r = client.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    else:
        r = client.post("/v1/chat/completions", json=body)
    assert_error(r, 400, word)


def test_fields_ignored_on_purpose_are_accepted_and_listed(client):
    ignored = {"user": "u-1", "metadata": {"run": "7"}, "store": False, "typical_p": 1.0, "mirostat": 0,
               "dry_multiplier": 0.0, "repeat_last_n": 64}
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8, **ignored})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == \
        client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 8}).json()["choices"][0]["message"]["content"]
    listed = client.get("/props").json()["ignored_fields"]
    assert {"user", "metadata", "store"} <= set(listed["any_value"]) and listed["only_this_value"]["typical_p"] == 1.0


@pytest.mark.parametrize("path,body,field", [
    ("/v1/completions", b'{"prompt": "a\\ud800"}', "prompt"),
    ("/tokenize", b'{"content": "\\ud800"}', "content"),
    ("/apply-template", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages.0.content"),
])
def test_a_lone_surrogate_is_a_400_naming_the_field(client, path, body, field):
    assert_error(client.post(path, content=body), 400, f"{field}: not valid Unicode text")


@pytest.mark.parametrize("headers", [{"Content-Type": "text/plain"}, {},
                                     {"Content-Type": "application/x-www-form-urlencoded"}])
def test_a_body_is_json_whatever_its_content_type_says(client, headers):
    body = b'{"prompt": "abc", "max_tokens": 2, "temperature": 0}'
    r = client.post("/v1/completions", content=body, headers=headers)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2
    assert_error(client.post("/v1/completions", content=b"prompt=abc", headers=headers), 400, "malformed JSON")


def test_the_schema_and_docs_are_open_and_document_the_error_shape(server, client):
    schema = httpx.get(f"{server.url}/openapi.json").json()
    assert {"/v1/chat/completions", "/v1/completions", "/tokenize", "/health", "/metrics"} <= schema["paths"].keys()
    chat = schema["paths"]["/v1/chat/completions"]["post"]
    assert {"400", "401", "404", "503"} <= chat["responses"].keys() and "422" not in chat["responses"]
    assert chat["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    assert "error" in schema["components"]["schemas"]["ErrorResponse"]["properties"]
    docs = httpx.get(f"{server.url}/docs")
    assert docs.status_code == 200 and "openapi.json" in docs.text
    assert_error(httpx.post(f"{server.url}/tokenize", json={"content": "a"}), 401, "API Key")


def test_other_refusals_and_the_server_still_serves(client):
    assert_error(client.post("/v1/chat/completions", json={**CHAT, "model": "gpt-4"}), 404, "gpt-4")
    assert_error(client.post("/v1/completions", content=b"x" * 70000), 413, "limit")
    assert_error(client.post("/v1/embeddings", json={"input": "hi"}), 404, "embeddings")
    assert_error(client.post("/rerank", json={}), 404)
    for model in ("tiny", "default", None):
        r = client.post("/v1/chat/completions", json={**CHAT, "model": model, "max_tokens": 2})
        assert r.status_code == 200, r.text


def test_disconnect_mid_stream_frees_the_slot(server, client):
    body = {**CHAT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with server.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_events(r)  # held: dropping the generator would close the response early
        for _ in range(4):
            next(events)
        assert any(s["is_processing"] for s in client.get("/slots").json())
    wait_idle(client)
    r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
    assert r.status_code == 200


def counters(client: httpx.Client) -> dict[str, float]:
    return {line.split()[0].removeprefix("tandem:"): float(line.split()[1])
            for line in client.get("/metrics").text.splitlines() if line.startswith("tandem:") and "{" not in line}


def test_metrics_count_a_request_whose_client_left_and_its_tokens(server, client):
    before = counters(client)
    body = {**CHAT, "max_tokens": 4000, "ignore_eos": True, "stream": True}
    with server.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        events = sse_events(r)
        for _ in range(6):  # the role chunk, then five chunks of at least one token each
            next(events)
    wait_idle(client)
    after = counters(client)
    assert after["requests_total"] == before["requests_total"] + 1
    assert after["requests_cancelled_total"] == before["requests_cancelled_total"] + 1
    assert after["tokens_predicted_total"] - before["tokens_predicted_total"] >= 5


EXTREMES = [("temperature", 1e-300), ("top_p", 1e-300), ("repeat_penalty", 1e-300),
            ("presence_penalty", -1e308), ("frequency_penalty", -1e308), ("logit_bias", {"15": 1e39})]


def test_extreme_sampling_values_are_served_and_leave_a_concurrent_stream_untouched(server, client):
    """The engine's sampling is total over every value validation admits: each extreme gets its
    tokens, and a stream running beside them gets exactly the tokens it gets alone."""
    body = {"prompt": "abc", "max_tokens": 256, "temperature": 0, "ignore_eos": True}
    alone = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    beside: list[dict] = []
    started = threading.Event()

    def stream():
        with server.client() as c, c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            for event in sse_events(r):
                beside.append(event)
                started.set()

    t = threading.Thread(target=stream)
    t.start()
    try:
        assert started.wait(30)
        for name, value in EXTREMES:
            r = client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 8, "ignore_eos": True,
                                                     name: value})
            assert r.status_code == 200, (name, r.text)
            assert r.json()["usage"]["completion_tokens"] == 8, name
    finally:
        t.join(timeout=60)
    assert beside[-1]["choices"][0]["finish_reason"] == "length" and beside[-1]["timings"]["predicted_n"] == 256
    assert "".join(c["choices"][0]["text"] for c in beside) == alone


def test_metrics_count_processing_and_deferred_and_answer_while_generating(server, client):
    body = {**CHAT, "max_tokens": 3000, "ignore_eos": True, "stream": True}
    done = threading.Event()

    def stream():
        with server.client() as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
            for _ in sse_events(r):
                if done.is_set():
                    break

    threads = [threading.Thread(target=stream) for _ in range(3)]  # three streams, two slots
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 20
        # Both gauges in one snapshot: between a stream's end and the waiting one's admission,
        # one slot is busy while the third request still waits.
        while not {"tandem:requests_deferred 1\n", "tandem:requests_processing 2\n"} <= \
                set((text := client.get("/metrics").text).splitlines(keepends=True)):
            assert time.monotonic() < deadline, text
        t0 = time.monotonic()
        assert client.get("/health").status_code == 200 and client.get("/slots").status_code == 200
        assert time.monotonic() - t0 < 2.0  # the event loop does not wait on forward passes
    finally:
        done.set()
        for t in threads:
            t.join(timeout=30)
    for name in ("prompt_tokens_total", "prompt_seconds_total", "tokens_predicted_total",
                 "tokens_predicted_seconds_total", "requests_processing", "requests_deferred",
                 "draft_tokens_total", "draft_tokens_accepted_total", "n_decode_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_count"):
        assert f"tandem:{name}" in text, name
    assert "tandem:requests_processing 2\n" in text
    wait_idle(client)
