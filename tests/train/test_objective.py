"""The training objective: padding a sequence for speed leaves its loss, labels and hits as they were."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.files.weights import open_model
from engine.model import mtp
from engine.model.layer_spec import DENSE
from train import objective
from train.data import Sequence
from train.draft import draft_tensors
from train.objective import Objective


def test_padding_a_training_sequence_leaves_its_loss_unchanged(tiny_model: Path, monkeypatch):
    """Training pads lengths to a multiple of PAD for speed; causal attention (and depth 2's mask)
    must keep the padded tail out of every real position's loss."""
    files = open_model(str(tiny_model))
    cfg, t = files.config, files.load_tensors()
    draft = mtp.MTPDraft(cfg, draft_tensors(cfg, t, torch.arange(64), "identity", 0, 2.0), [DENSE], "f32", 256)
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
        monkeypatch.setattr(objective, "PAD", pad)
        with torch.no_grad():
            loss, labeled, hits = objective.sequence_loss(draft, embed, seq, obj)
        results[pad] = (float(loss), labeled, hits)
    assert results[1][1] == int(((labels >= 0) & (labels < 64)).sum())
    for pad in (16, 64):
        assert results[pad][1:] == results[1][1:]
        assert results[pad][0] == pytest.approx(results[1][0], rel=1e-5)
