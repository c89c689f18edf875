"""A user's Llama 3 file split in parts (tests/fixtures/llama3: llama.cpp's converter, then
llama-gguf-split) served by the main command given its first part: llama-server's greedy tokens on
the same file, by the exact-token rule, through /completion."""
from __future__ import annotations

from engine.model.transformer import Transformer
from engine.files.weights import open_model
from tests.engine.test_llama3_gguf import LLAMA, MODEL
from tests.exact_tokens import assert_same_greedy, next_token_logits


def test_the_main_command_serves_a_split_llama_3_file_as_llama_server_does(start_server):
    server = start_server(["-m", str(MODEL), "-c", "512"])
    with server.client() as c:
        got = [c.post("/completion", json={"prompt": prompt, "n_predict": LLAMA["n_predict"], "temperature": 0,
                                           "ignore_eos": True}) for prompt in LLAMA["prompts"]]
        props = c.get("/props").json()
    assert all(r.status_code == 200 for r in got), [r.text for r in got]
    assert props["model_path"] == str(MODEL)
    files = open_model(MODEL)
    logits = next_token_logits(Transformer(files.config, files.load_tensors(), dtype="f32", max_positions=512))
    for r, prompt, theirs in zip(got, LLAMA["prompts"], LLAMA["answers"]):
        assert_same_greedy(r.json()["tokens"], theirs["tokens"], prompt, logits)
