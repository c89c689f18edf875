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
    assert "q4_0 72.2 MiB, q4_1 80.2 MiB, q5_0 88.2 MiB, q8_0 136.3 MiB" in out  # each format, quantized on load


def test_validate_reports_a_k_quant_files_matrices_as_stored(capsys):
    from tests.engine.test_kquants_gguf import model
    assert main([str(model("Q4_K_M"))]) == 0
    # 12 Q4_K matrices and 3 Q6_K, as stored (144 and 210 bytes per 256 weights); the norms f32.
    assert "weights as stored (--dtype auto): q4_k 0.5 MiB (12 tensors), q6_k 0.2 MiB (3 tensors), " \
           "f32 0.0 MiB (5 tensors)" in capsys.readouterr().out


def test_validate_reports_a_hybrid_models_layer_kinds_state_and_mtp_layer(capsys):
    from tests.engine.test_qwen3_5_gguf import MODEL, MTP_ONLY
    assert main([str(MODEL), "-c", "1024"]) == 0
    out = capsys.readouterr().out
    assert "layer kinds:  2 linear_attention (Gated DeltaNet), 2 full_attention (layers 1,3)" in out
    assert "linear attn:  2 key heads x 16, 4 value heads x 16, conv kernel 4 (value heads tiled" in out
    # Per linear layer: the state 4 x 16 x 16 and the conv tail 3 x 128 f32 values; two such layers.
    assert "state:        11.0 KiB per slot and position kept" in out
    assert "attention:    gated output, RoPE on 8 of 32 dims" in out
    assert "KV cache at 1024 positions, f32, dense (2 layers): 1.0 MiB" in out  # the attention layers alone
    assert "MTP:          1 layer(s) of the model's own (blk.N.nextn.*)" in out
    assert main([str(MTP_ONLY)]) == 0
    out = capsys.readouterr().out
    assert "this file holds no trunk: give it as -md" in out and "f32 0.3 MiB (15 tensors)" in out
