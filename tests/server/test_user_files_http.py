"""Files as users hold them, served by the main command: a Llama 3 file split in parts, given by its
first part (tests/fixtures/llama3: llama.cpp's converter, then llama-gguf-split), and a Q4_K_M file
(tests/fixtures/kquants: llama-quantize) give llama-server's greedy tokens on the same file, by the
exact-token rule, through /completion."""
from __future__ import annotations

import pytest

from engine.files.weights import open_model
from engine.model.transformer import Transformer
from tests.engine import test_kquants_gguf, test_llama3_gguf
from tests.exact_tokens import assert_same_greedy, next_token_logits

FILES = {"split llama 3": (test_llama3_gguf.MODEL, test_llama3_gguf.LLAMA["answers"]),
         "Q4_K_M": (test_kquants_gguf.model("Q4_K_M"), test_kquants_gguf.LLAMA["answers"]["Q4_K_M"])}
PROMPTS = test_llama3_gguf.LLAMA["prompts"]
assert PROMPTS == test_kquants_gguf.LLAMA["prompts"]


@pytest.mark.parametrize("name", FILES)
def test_the_main_command_serves_the_file_as_llama_server_does(start_server, name):
    path, answers = FILES[name]
    server = start_server(["-m", str(path), "-c", "512"])
    with server.client() as c:
        got = [c.post("/completion", json={"prompt": prompt, "n_predict": len(answer["tokens"]), "temperature": 0,
                                           "ignore_eos": True}) for prompt, answer in zip(PROMPTS, answers)]
        props = c.get("/props").json()
    assert all(r.status_code == 200 for r in got), [r.text for r in got]
    assert props["model_path"] == str(path)
    files = open_model(path)
    # The reference: the file's own numbers in f32, as llama.cpp dequantizes them.
    logits = next_token_logits(Transformer(files.config, files.load_tensors(), dtype="f32", max_positions=512))
    for r, prompt, theirs in zip(got, PROMPTS, answers):
        assert_same_greedy(r.json()["tokens"], theirs["tokens"], prompt, logits)
