"""`python -m engine.cli.validate`: a model's summary from its headers, with the compression flags
applied and the cache's bytes per layer kind; a bad value exits 2 with one message."""
from __future__ import annotations

from engine.cli.tiny import tiny_config, write_tiny_model
from engine.cli.validate import main


def test_validate_reports_kv_and_pooled_key_bytes_per_layer_kind(tmp_path, capsys):
    config = tiny_config("llama", num_hidden_layers=8)
    path = write_tiny_model(config, tmp_path / "m", seed=0)
    assert main([str(path), "--compress-ratios", "every4:4", "--qsa-budget", "16", "-c", "1024", "-np", "2"]) == 0
    out = capsys.readouterr().out
    # kv_size 32: a dense position costs 2 x 32 x 4 bytes per layer; a QSA one adds 32 x 4 / 4 for its pool.
    assert "KV cache at 1024 positions, f32, dense (6 layers): 1.5 MiB" in out
    assert "KV cache at 1024 positions, f32, qsa r=4 (2 layers): 512.0 KiB, kpool 64.0 KiB" in out
    assert main([str(path), "--compress-ratios", "every4:4"]) == 2
    assert "qsa_budget=0: must be a positive multiple of the compress ratio 4" in capsys.readouterr().err


def test_validate_reports_the_weights_as_the_file_stores_them(capsys):
    assert main(["default"]) == 0
    out = capsys.readouterr().out
    assert "weights as stored (--dtype auto): q4_1 63.3 MiB (210 tensors), q8_0 28.7 MiB (1 tensors), " \
           "f32 0.1 MiB (61 tensors)" in out
    assert "q4_0 72.2 MiB, q4_1 80.2 MiB, q8_0 136.3 MiB" in out  # each format, quantized on load
