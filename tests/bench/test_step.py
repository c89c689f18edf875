"""bench.step splits a decode step into its parts, per weight format, on the model's own weights."""
from __future__ import annotations

import re

from bench.step import main
from engine.cli.tiny import tiny_config, write_tiny_model


def test_step_profile_gives_each_part_its_time_and_weight_bytes(tmp_path, capsys):
    config = tiny_config()
    model = write_tiny_model(config, tmp_path, seed=0)
    assert main(["-m", str(model), "--dtypes", "int8", "q4_1", "--reps", "3", "--tg", "8", "--context", "16",
                 "-t", "1"]) == 0
    out = capsys.readouterr().out
    sections = dict(re.findall(r"^tandem (\w+): decode step [\d.]+ ms.*?\n(.*?)(?=\n\n|\Z)", out, re.M | re.S))
    assert set(sections) == {"int8", "q4_1"}
    mb = {}
    for fmt, text in sections.items():
        rows = {m[1].strip(): (float(m[2]), float(m[3])) for m in
                re.finditer(r"^(linear [\w.]+|attention|decoder layers \(one call\)|lm_head)\s+([\d.]+)\s+\d+%\s+([\d.]+)",
                            text, re.M)}
        assert set(rows) == {"linear self_attn.qkv_proj", "linear self_attn.o_proj", "linear mlp.gate_up_proj",
                             "linear mlp.down_proj", "attention", "decoder layers (one call)", "lm_head"}
        assert all(ms > 0 for ms, _ in rows.values())
        # The layers' call reads what the four kinds of linear layer hold, and attention no weights.
        kinds = sum(mb for part, (_, mb) in rows.items() if part.startswith("linear"))
        assert abs(rows["decoder layers (one call)"][1] - kinds) < 0.003 and rows["attention"][1] == 0
        mb[fmt] = kinds
        assert re.search(r"^rest of the step\s+-?[\d.]+", text, re.M)
        assert re.search(r"^a verify row of 1 \+ 3 tokens costs [\d.]+x a decode row", text, re.M)
    assert mb["q4_1"] < mb["int8"]


def test_a_model_of_residual_streams_has_its_layers_one_call_timed(tmp_path, capsys):
    # Qwen4-Exp's layers take hc_count streams side by side: its one call is timed on those.
    model = write_tiny_model(tiny_config("qwen4_exp"), tmp_path, seed=0)
    assert main(["-m", str(model), "--dtypes", "f32", "--reps", "2", "--tg", "4", "--context", "16", "-t", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^decoder layers \(one call\)\s+[\d.]+\s+\d+%", out, re.M)
    assert re.search(r"^a verify row of 1 \+ 3 tokens costs [\d.]+x a decode row", out, re.M)
