"""bench.compare runs every system it can on one model and reports each against transformers."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from bench.compare import main
from engine.cli.tiny import tiny_config, write_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    config = tiny_config()
    return write_tiny_model(config, tmp_path_factory.mktemp("tiny-compare"), seed=0)


def test_compare_measures_each_system_against_transformers(tiny_model, capsys):
    assert main(["-m", str(tiny_model), "--runs", "2", "--pp", "32", "--tg", "12", "--heldout", "0", "-t", "1"]) == 0
    out = capsys.readouterr().out
    assert "llama.cpp: skipped (the model is not a GGUF file)" in out
    rows = {m[1].strip(): m for m in re.finditer(r"^(tandem f32[^\d]*|transformers f32[^\d]*?)\s+([\d.]+)\s+([\d.]+)x\s+-"
                                                  r"\s+([\d.]+)\s+([\d.]+)x", out, re.M)}
    assert set(rows) == {"tandem f32", "tandem f32 + ngram-simple", "transformers f32",
                         "transformers f32 + prompt lookup"}
    for m in rows.values():
        assert float(m[2]) > 0 and float(m[4]) > 0
    assert float(rows["transformers f32"][3]) == 1.0 and float(rows["transformers f32"][5]) == 1.0
    assert re.search(r"TG ceiling at batch 1, f32 weights \(\d+ MB per token\): [\d.]+ tok/s", out)
