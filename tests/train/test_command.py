"""`python -m train` end to end on a tiny target: it generates its data through the engine,
trains, evaluates on held-out answers and writes a draft file that the engine then serves."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.engine import Engine
from engine.files.tokenizer import Tokenizer
from engine.files.weights import open_model
from engine.sched.sampling import SamplingParams
from engine.settings import EngineConfig, SpecConfig
from tests.engine.test_generation import run_alone
from tests.server.helpers import ROOT
from train.data import Data
from train.prompts import licence_chunks

PROMPTS, HELDOUT, MAX_TOKENS, TEXT_TOKENS = 12, 4, 20, 600


# The formats that generate fast: int8 made the committed draft's later data; bf16 computes in bf16,
# so its hidden states must go back to bf16 before the licence text is labelled.
@pytest.mark.parametrize("dtype", ["int8", "bf16"])
def test_a_run_generates_trains_and_writes_a_draft_the_engine_serves(tiny_model: Path, tmp_path: Path, dtype: str):
    out, data = tmp_path / "draft.safetensors", tmp_path / "data.pt"
    cmd = [sys.executable, "-m", "train", "--model", str(tiny_model), "--out", str(out), "--data", str(data),
           "--prompts", str(PROMPTS), "--heldout", str(HELDOUT), "--max-tokens", str(MAX_TOKENS),
           "--text-tokens", str(TEXT_TOKENS), "--subset", "64", "--minutes", "0.1", "--depth2", "1.0",
           "--depth2-after", "0.5", "--dtype", dtype, "--parallel", "4", "--threads", "1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    cached = Data.load(str(data))
    texts = len(licence_chunks(Tokenizer.load(open_model(str(tiny_model))), TEXT_TOKENS))
    assert (cached.prompts, cached.text_chunks) == (PROMPTS, texts)
    assert (len(cached.train), len(cached.heldout)) == (PROMPTS + texts, HELDOUT)
    for s in cached.train[texts:] + cached.heldout:  # labels: the answer shifted by one, -1 over the prompt
        answer = s.labels[s.labels >= 0]
        assert 0 < len(answer) <= MAX_TOKENS
        assert torch.equal(answer[:-1], s.next_ids[-len(answer) + 1:][:len(answer) - 1])
    record = json.loads(out.with_suffix(".json").read_text())
    assert (record["data"]["prompts"], record["data"]["text_chunks"]) == (PROMPTS, texts)
    assert record["train"]["steps"] > 0
    assert record["heldout"]["positions"] == sum(int((s.labels >= 0).sum()) for s in cached.heldout)
    assert 0 <= record["heldout"]["accept1"] <= 1 and record["heldout"]["coverage"] > 0

    plain = Engine.load(EngineConfig(model=str(tiny_model), ctx_size=256))
    spec = SpecConfig(type="draft-mtp", draft_model=str(out), n_max=3, p_min=0.0)
    speculative = Engine.load(EngineConfig(model=str(tiny_model), ctx_size=256, spec=spec))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = plain.tokenizer.encode("the tide comes in")
    assert run_alone(speculative, prompt, params) == run_alone(plain, prompt, params)
    assert sum(speculative.stats.drafted_at) > 0  # the draft proposed, and the target kept its own answer
