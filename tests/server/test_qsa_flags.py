"""Every invalid compress ratio or QSA budget, wherever it comes from (config.json, GGUF metadata, the
draft file, a flag), stops `python -m server` before it listens: exit code 2 and one message naming
field, value and rule."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from bench.processes import ROOT, free_port
from engine.files.weights import open_model
from engine.model import mtp
from tests.engine.test_gguf import Q, write_gguf
from tests.engine.test_mtp import save_draft


def start(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server", "--port", str(free_port()), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def sources(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("qsa-sources")
    config_dir = root / "config"
    shutil.copytree(tiny_model, config_dir)
    config = json.loads((config_dir / "config.json").read_text())
    (config_dir / "config.json").write_text(json.dumps({**config, "compress_ratios": [0, 4, 8], "qsa_budget": 64}))
    write_gguf(root / "short.gguf", Q.F32, compress_ratios=[4, 4], qsa_budget=64)
    write_gguf(root / "budget.gguf", Q.F32, compress_ratios=[0, 4, 4], qsa_budget=6)
    files = open_model(tiny_model)
    tensors = files.load_tensors()
    fingerprint = mtp.target_fingerprint(files.config, tensors["model.embed_tokens.weight"])
    draft = save_draft(root / "draft.safetensors", files.config, tensors, fingerprint)
    mtp.save(root / "draft-r8.safetensors", draft, num_layers=1, fingerprint=fingerprint, target_name="tiny",
             dtype=torch.bfloat16, compress_ratios=(8,))
    return root


CASES = {
    "config.json": (lambda r, m: ["-m", str(r / "config")],
                    "compress_ratios[2]=8: QSA layers must share one compress ratio (layer 1 has 4)"),
    "GGUF entries": (lambda r, m: ["-m", str(r / "short.gguf")],
                     "compress_ratios has 2 entries: needs one per layer (3 trunk + 0 MTP = 3)"),
    "GGUF budget": (lambda r, m: ["-m", str(r / "budget.gguf")],
                    "qsa_budget=6: must be a positive multiple of the compress ratio 4"),
    "flag syntax": (lambda r, m: ["-m", str(m), "--compress-ratios", "4,1,0"],
                    "--compress-ratios='4,1,0': must be a comma list of ratios (0 or >= 2), everyN:R, all:R or none"),
    "flag budget": (lambda r, m: ["-m", str(m), "--compress-ratios", "every2:4", "--qsa-budget", "6"],
                    "qsa_budget=6: must be a positive multiple of the compress ratio 4"),
    "flag count": (lambda r, m: ["-m", str(m), "--compress-ratios", "0,4"],
                   "compress_ratios has 2 entries: needs one per trunk layer (3)"),
    "unified page": (lambda r, m: ["-m", str(m), "--compress-ratios", "all:3", "--qsa-budget", "63", "--kv-unified"],
                     "compress_ratios: ratio 3 must divide the KV page size 16 with kv_unified"),
    "draft file": (lambda r, m: ["-m", str(m), "--compress-ratios", "all:4", "--qsa-budget", "64", "--spec-type",
                                 "draft-mtp", "-md", str(r / "draft-r8.safetensors")],
                   "compress_ratios[3]=8: QSA layers must share one compress ratio (layer 0 has 4)"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_an_invalid_ratio_or_budget_exits_2_before_serving(sources, tiny_model, case):
    args, message = CASES[case]
    done = start(args(sources, tiny_model))
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == f"error: {message}"
    assert "listening" not in done.stderr
