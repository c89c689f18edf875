"""bench.quality reads held-out text as llama-perplexity does and scores each system against the f32
reference: the reference itself at KL 0 and full agreement, a block format with 8-bit activations
at a small positive KL, each row of its table a system."""
from __future__ import annotations

import re

import pytest
import torch

from bench.quality import chunks_of, compare, main
from engine import cpu
from engine.cli.tiny import tiny_config, write_tiny_model


def test_the_reference_scores_zero_divergence_and_a_shifted_distribution_does_not():
    torch.manual_seed(0)
    ref = torch.log_softmax(torch.randn(6, 10), -1)
    targets = torch.randint(0, 10, (6,))
    same = compare("same", ref, targets, ref)
    assert same.kl == 0 and same.agreement == 1
    assert same.perplexity == pytest.approx(torch.exp(-ref[torch.arange(6), targets].mean()).item())
    other = compare("other", torch.log_softmax(torch.randn(6, 10), -1), targets, ref)
    assert other.kl > 0


def test_a_text_shorter_than_one_chunk_is_refused_by_its_length():
    with pytest.raises(SystemExit, match="fewer than one chunk of --ctx 512"):
        chunks_of(list(range(100)), 512, 4)
    assert [len(c) for c in chunks_of(list(range(1100)), 512, 4)] == [512, 512]


def test_the_table_scores_each_system_of_a_tiny_model(tmp_path, capsys):
    model = write_tiny_model(tiny_config(), tmp_path, seed=0)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i % 37} and more {i}" for i in range(400)))
    activations = "q8" if cpu.has_q8_activations() else "f32"
    assert main(["-m", str(model), "--text", str(text), "--ctx", "64", "--chunks", "3",
                 "--systems", f"q8_0:{activations}", "-t", "1"]) == 0
    rows = dict((m[1], (float(m[2]), float(m[3]), float(m[4]))) for m in
                re.finditer(r"^\| tandem (\S+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|$", capsys.readouterr().out, re.M))
    assert set(rows) == {"f32:f32", f"q8_0:{activations}"}
    assert rows["f32:f32"][1:] == (0.0, 1.0)
    ppl, kl, agreement = rows[f"q8_0:{activations}"]
    assert 0 < kl < 0.05 and agreement > 0.8 and ppl > 1
