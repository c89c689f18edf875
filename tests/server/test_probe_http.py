"""`attention_probe` through HTTP: the result once, in the whole response and in the SSE chunk with
finish_reason, for completions and chat; qk as base64 f32 with its shape; the same text as without a
probe; bad specs answered 400 naming the field."""
from __future__ import annotations

import base64

import numpy as np
import pytest

from tests.server.helpers import sse_events

PROMPT = "the tide comes in and the tide goes out, and the shore keeps every shell"
BODY = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
PROBE = {"layers": [0, -1], "group": 4}


@pytest.fixture(scope="module")
def server(start_server, tiny_model):
    s = start_server(["-m", str(tiny_model), "-c", "1024", "-np", "2"])
    yield s
    s.kill()


def post(server, path: str, body: dict) -> dict:
    with server.client() as c:
        r = c.post(path, json=body)
    assert r.status_code == 200, r.text
    return r.json()


def streamed(server, path: str, body: dict) -> list[dict]:
    with server.client() as c, c.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200
        return list(sse_events(r))


def assert_same_probe(a: dict, b: dict) -> None:
    assert {k: v for k, v in a.items() if k != "layers"} == {k: v for k, v in b.items() if k != "layers"}
    for x, y in zip(a["layers"], b["layers"], strict=True):
        assert {k: v for k, v in x.items() if k != "values"} == {k: v for k, v in y.items() if k != "values"}
        np.testing.assert_allclose(x["values"], y["values"], atol=1e-6)


@pytest.mark.parametrize("path, body", [("/v1/completions", BODY),
                                        ("/v1/chat/completions", {**{k: v for k, v in BODY.items() if k != "prompt"},
                                                                  "messages": [{"role": "user", "content": PROMPT}]})])
def test_the_probe_comes_once_whole_and_streamed_and_changes_no_text(server, path, body):
    plain = post(server, path, body)
    whole = post(server, path, {**body, "attention_probe": PROBE})
    assert "attention_probe" not in plain
    assert whole["choices"] == plain["choices"]
    probe = whole["attention_probe"]
    n = whole["usage"]["prompt_tokens"]
    assert probe["kind"] == "head_mean" and probe["query"] == "last" and probe["group"] == 4
    assert [r["layer"] for r in probe["layers"]] == [0, 2]
    for layer in probe["layers"]:
        assert layer["query_positions"] == [n - 1] and layer["key_positions"] == [0, n]
        assert layer["shape"] == [-(-n // 4)] and len(layer["values"]) == layer["shape"][0]
        # Group means of weights that sum to 1 over n keys: sizes times means sum to 1 too.
        sizes = [min(4, n - 4 * g) for g in range(layer["shape"][0])]
        assert abs(sum(s * v for s, v in zip(sizes, layer["values"])) - 1) < 1e-5
        assert layer["sparse"] is False
    chunks = streamed(server, path, {**body, "attention_probe": PROBE})
    carrying = [c for c in chunks if "attention_probe" in c]
    assert len(carrying) == 1 and carrying[0]["choices"][0]["finish_reason"] == "length"
    assert_same_probe(carrying[0]["attention_probe"], probe)


def test_qk_comes_as_base64_f32_and_the_prompt_is_recomputed(server):
    post(server, "/v1/completions", BODY)  # caches the prompt: a qk probe must not use it
    out = post(server, "/v1/completions", {**BODY, "attention_probe": {"layers": [1], "kind": "qk", "query": {"last": 3}}})
    n = out["usage"]["prompt_tokens"]
    assert out["timings"]["probe_recomputed"] is True and out["timings"]["cache_n"] == 0
    (layer,) = out["attention_probe"]["layers"]
    assert layer["query_positions"] == [n - 3, n - 2, n - 1] and layer["key_positions"] == [0, n]
    for name, positions in (("q", 3), ("k", n)):
        packed = layer[name]
        values = np.frombuffer(base64.b64decode(packed["data"]), dtype="<f4").reshape(packed["shape"])
        assert packed["dtype"] == "float32" and values.shape[0] == positions and np.isfinite(values).all()


def test_a_last_query_probe_reads_the_cached_prefix(server):
    post(server, "/v1/completions", BODY)
    out = post(server, "/v1/completions", {**BODY, "attention_probe": PROBE})
    assert out["timings"]["cache_n"] > 0 and "probe_recomputed" not in out["timings"]


@pytest.mark.parametrize("probe, field", [
    ({"layers": []}, "attention_probe.layers"),
    ({"layers": [3]}, "attention_probe.layers=3"),
    ({"layers": [0, -3]}, "attention_probe.layers"),  # layer 0 twice
    ({"layers": [0], "kind": "keys"}, "attention_probe.kind"),
    ({"layers": [0], "query": "first"}, "attention_probe.query"),
    ({"layers": [0], "query": {"last": 0}}, "attention_probe.query"),
    ({"layers": [0], "query": {"last": 2000}}, "attention_probe.query.last"),
    ({"layers": [0], "query": 500}, "attention_probe.query=500"),
    ({"layers": [0], "group": 0}, "attention_probe.group"),
    ({"layers": [0], "reduce": "max"}, "attention_probe.reduce"),
    ({"layers": [0], "kind": "qk", "group": 2}, "attention_probe.group"),
    ({"layers": [0], "colour": "red"}, "attention_probe.colour: unknown key"),
    ("yes", "attention_probe"),
])
def test_bad_probes_are_answered_400_naming_the_field(server, probe, field):
    with server.client() as c:
        r = c.post("/v1/completions", json={**BODY, "attention_probe": probe})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(field), r.json()
