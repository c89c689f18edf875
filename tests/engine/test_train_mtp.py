"""`python -m engine.train_mtp` end to end on a tiny target: it generates its data through the engine,
trains, evaluates on held-out answers and writes a draft file that the engine then serves."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine import mtp, train_mtp
from engine.drafter import SpecConfig
from engine.engine import Engine, EngineConfig
from engine.sampling import SamplingParams
from engine.tiny import write_tiny_model
from engine.tokenizer import Tokenizer
from engine.train_mtp import Data, Objective, Sequence, draft_tensors, licence_chunks
from engine.weights import open_model
from tests.engine.test_generation import run_alone
from tests.server.helpers import ROOT

CONFIGS = ROOT / "configs" / "tiny"
PROMPTS, HELDOUT, MAX_TOKENS, TEXT_TOKENS = 12, 4, 20, 600


# The formats that generate fast: int8 made the committed draft's later data; bf16 computes in bf16,
# so its hidden states must go back to bf16 before the licence text is labelled.
@pytest.mark.parametrize("dtype", ["int8", "bf16"])
def test_a_run_generates_trains_and_writes_a_draft_the_engine_serves(tmp_path: Path, dtype: str):
    model = write_tiny_model(json.loads((CONFIGS / "llama.json").read_text()), tmp_path / "target")
    out, data = tmp_path / "draft.safetensors", tmp_path / "data.pt"
    cmd = [sys.executable, "-m", "engine.train_mtp", "--model", str(model), "--out", str(out), "--data", str(data),
           "--prompts", str(PROMPTS), "--heldout", str(HELDOUT), "--max-tokens", str(MAX_TOKENS),
           "--text-tokens", str(TEXT_TOKENS), "--subset", "64", "--minutes", "0.1", "--depth2", "1.0",
           "--depth2-after", "0.5", "--dtype", dtype, "--parallel", "4", "--threads", "1"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    cached = Data.load(str(data))
    texts = len(licence_chunks(Tokenizer.load(open_model(str(model))), TEXT_TOKENS))
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

    plain = Engine.load(EngineConfig(model=str(model), ctx_size=256))
    spec = SpecConfig(type="draft-mtp", draft_model=str(out), n_max=3, p_min=0.0)
    speculative = Engine.load(EngineConfig(model=str(model), ctx_size=256, spec=spec))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompt = plain.tokenizer.encode("the tide comes in")
    assert run_alone(speculative, prompt, params) == run_alone(plain, prompt, params)
    assert sum(speculative.stats.drafted_at) > 0  # the draft proposed, and the target kept its own answer


def test_padding_a_training_sequence_leaves_its_loss_unchanged(tmp_path: Path, monkeypatch):
    """Training pads lengths to a multiple of PAD for speed; causal attention (and depth 2's mask)
    must keep the padded tail out of every real position's loss."""
    model = write_tiny_model(json.loads((CONFIGS / "llama.json").read_text()), tmp_path / "target")
    files = open_model(str(model))
    cfg, t = files.config, files.load_tensors()
    draft = mtp.MTPDraft(cfg, draft_tensors(cfg, t, torch.arange(64), "identity", 0, 2.0), 1, "f32", 256)
    embed = torch.nn.Embedding.from_pretrained(t["model.embed_tokens.weight"])
    g = torch.Generator().manual_seed(0)
    n = 37
    labels = torch.randint(0, 80, (n,), generator=g)  # some outside the 64-token subset
    labels[:9] = -1  # a prompt
    labels[-1] = -1  # the label at i is the target's argmax at i+1: none at the last position
    seq = Sequence(torch.randn(n, cfg.hidden_size, generator=g), torch.randint(0, cfg.vocab_size, (n,), generator=g),
                   labels)
    obj = Objective.for_draft(draft, depth2=1.0, soft=0.5)
    results = {}
    for pad in (1, 16, 64):
        monkeypatch.setattr(train_mtp, "PAD", pad)
        with torch.no_grad():
            loss, labeled, hits = train_mtp.sequence_loss(draft, embed, seq, obj)
        results[pad] = (float(loss), labeled, hits)
    assert results[1][1] == int(((labels >= 0) & (labels < 64)).sum())
    for pad in (16, 64):
        assert results[pad][1:] == results[1][1:]
        assert results[pad][0] == pytest.approx(results[1][0], rel=1e-5)
