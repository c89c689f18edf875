"""The shape tandem is built for, through HTTP: a trunk with QSA r=4 on every fourth layer, a
detached MTP draft beside it, two slots decoding at once, prompts past the budget. It starts (the
known failure of this shape elsewhere was a crash at startup), serves, and speculation stays
lossless with a draft whose own layer is QSA."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.engine.test_qsa_engine import write_llama8_with_drafts

QSA = ["--compress-ratios", "every4:4", "--qsa-budget", "8", "-np", "2", "-c", "512"]
PROMPTS = ["the tide comes in and the tide goes out, and the shore keeps every shell the tide leaves behind",
           "a lantern in the window of the harbour master's house, lit every night for forty years"]


@pytest.fixture(scope="module")
def llama8(tmp_path_factory):
    return write_llama8_with_drafts(tmp_path_factory.mktemp("llama8"))


def complete_both(server) -> list[dict]:
    bodies = [{"prompt": p, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
              for p in PROMPTS]
    with server.client() as c, ThreadPoolExecutor(2) as pool:
        responses = list(pool.map(lambda body: c.post("/v1/completions", json=body), bodies))
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    return [r.json() for r in responses]


@pytest.fixture(scope="module")
def plain_texts(start_server, llama8):
    server = start_server(["-m", str(llama8), *QSA])
    try:
        with server.client() as c:
            props = c.get("/props").json()
        assert props["compress_ratios"] == [0, 0, 0, 4, 0, 0, 0, 4] and props["qsa_budget"] == 8
        assert "KV cache: 8 layers (6 dense, 2 qsa r=4) x 2 slots x 256 ctx" in server.log_text()
        results = complete_both(server)
        assert all(r["usage"]["prompt_tokens"] > 2 * 8 for r in results)  # past the budget
        return [r["choices"][0]["text"] for r in results]
    finally:
        server.kill()


# A dense draft beside the QSA trunk is a cell of tests/server/test_combinations.py.
def test_qsa_trunk_with_a_qsa_mtp_draft_serves_two_slots_losslessly(start_server, llama8, plain_texts):
    server = start_server(["-m", str(llama8), *QSA, "--spec-type", "draft-mtp", "-md", str(llama8 / "qsa-draft.safetensors"),
                           "--spec-draft-p-min", "0", "--spec-max-batch", "0"])  # both slots draft at once
    try:
        results = complete_both(server)
    finally:
        server.kill()
    assert [r["choices"][0]["text"] for r in results] == plain_texts
    assert all(r["timings"]["draft_n"] > 0 for r in results)
