"""A bad model is refused when it is opened, with one error naming the field, the value and the rule,
and opening reads headers only: no tensor data."""
from __future__ import annotations

import json
import math
import shutil
import struct
from pathlib import Path

import pytest
from safetensors import SafetensorError

from engine.cli.tiny import tiny_config, write_tiny_model
from engine.errors import ConfigError, WeightsError
from engine.files.tokenizer import Tokenizer
from engine.files.weights import open_model


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[str, Path]:
    """Valid tiny models, written once; tests change copies of them."""
    return {name: write_tiny_model(tiny_config(name), tmp_path_factory.mktemp(name))
            for name in ("llama", "qwen2", "mistral")}


def copy_with(src: Path, dst: Path, **config_changes) -> Path:
    """A copy of model `src` whose config.json has `config_changes` applied (None removes a key)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in config_changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def shapes_of(path: Path) -> dict[str, list[int]]:
    """Tensor shapes declared in the model's safetensors header."""
    with open(path / "model.safetensors", "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {name: info["shape"] for name, info in header.items() if name != "__metadata__"}


def write_header_only(path: Path, shapes: dict[str, list[int]]) -> None:
    """Replaces the model's weights with a safetensors header declaring `shapes`, and no data bytes."""
    offset, entries = 0, {}
    for name, shape in shapes.items():
        size = 4 * math.prod(shape)
        entries[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(entries).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)


def open_error(path: Path, kind: type[Exception] = ConfigError) -> str:
    with pytest.raises(kind) as e:
        open_model(path)
    return str(e.value)


def test_hidden_size_must_split_evenly_into_heads_without_head_dim(tiny_dirs, tmp_path):
    path = copy_with(tiny_dirs["llama"], tmp_path / "m", hidden_size=66, head_dim=None)
    assert open_error(path) == \
        "hidden_size=66: must be divisible by num_attention_heads=4 when head_dim is absent"


def test_kv_heads_must_divide_heads(tiny_dirs, tmp_path):
    path = copy_with(tiny_dirs["llama"], tmp_path / "m", num_key_value_heads=3)
    assert open_error(path) == "num_key_value_heads=3: must divide num_attention_heads=4"


def test_unknown_architecture_is_refused(tiny_dirs, tmp_path):
    path = copy_with(tiny_dirs["llama"], tmp_path / "m", model_type="gpt2")
    assert open_error(path) == "model_type='gpt2': unknown architecture (supported: llama, mistral, qwen2, qwen3, qwen3_5, qwen4_exp)"


def test_unsupported_rope_scaling_is_refused(tiny_dirs, tmp_path):
    path = copy_with(tiny_dirs["llama"], tmp_path / "m",
                     rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    assert open_error(path) == \
        "rope_parameters.rope_type='dynamic': unsupported RoPE scaling (supported: default, linear, llama3, yarn)"


def test_sliding_window_attention_is_refused(tiny_dirs, tmp_path):
    path = copy_with(tiny_dirs["mistral"], tmp_path / "m", sliding_window=4096)
    assert open_error(path) == "sliding_window=4096: sliding-window attention is not supported (set it to null)"


def test_sliding_window_size_is_ignored_when_qwen2_disables_it(tiny_dirs, tmp_path):
    # Released Qwen2 configs carry a window size next to use_sliding_window: false.
    path = copy_with(tiny_dirs["qwen2"], tmp_path / "m", sliding_window=32768, use_sliding_window=False)
    assert open_model(path).config.family == "qwen2"


@pytest.mark.parametrize("ratios, budget, message", [
    ([0, 4], 64, "compress_ratios has 2 entries: needs one per layer (3 trunk + 0 MTP = 3)"),
    ([0, 1, 0], 64, "compress_ratios[1]=1: must be 0 (dense) or >= 2 (QSA)"),
    ([0, 4, 8], 64, "compress_ratios[2]=8: QSA layers must share one compress ratio (layer 1 has 4)"),
    ([0, 4, 4], 6, "qsa_budget=6: must be a positive multiple of the compress ratio 4"),
    ([0, 4, 4], 0, "qsa_budget=0: must be a positive multiple of the compress ratio 4"),
])
def test_compress_ratios_breaking_a_rule_are_refused(tiny_dirs, tmp_path, ratios, budget, message):
    path = copy_with(tiny_dirs["llama"], tmp_path / "m", compress_ratios=ratios, qsa_budget=budget)
    assert open_error(path) == message


def test_compress_ratios_list_trunk_layers_then_mtp_layers(tiny_dirs, tmp_path):
    path = copy_with(tiny_dirs["llama"], tmp_path / "m", compress_ratios=[4, 0, 4, 0], qsa_budget=64,
                     num_nextn_predict_layers=1)
    assert open_model(path).config.layer_ratios == (4, 0, 4)


@pytest.mark.parametrize("ratios, budget, unified, message", [
    ("0,4", None, False, "compress_ratios has 2 entries: needs one per trunk layer (3)"),
    ("every2:4", None, False, "qsa_budget=0: must be a positive multiple of the compress ratio 4"),
    ("all:4", 6, False, "qsa_budget=6: must be a positive multiple of the compress ratio 4"),
    ("0,4,8", 64, False, "compress_ratios[2]=8: QSA layers must share one compress ratio (layer 1 has 4)"),
    ("all:3", 63, True, "compress_ratios: ratio 3 must divide the KV page size 16 with kv_unified"),
])
def test_compression_flags_breaking_a_rule_are_refused_before_weights_are_read(tiny_dirs, monkeypatch, ratios,
                                                                               budget, unified, message):
    from engine.engine import Engine
    from engine.settings import CompressRatios, EngineConfig
    files = type(open_model(tiny_dirs["llama"]))
    monkeypatch.setattr(files, "load_tensors", lambda self: pytest.fail("tensor data was read"))
    config = EngineConfig(model=str(tiny_dirs["llama"]), ctx_size=64, kv_unified=unified,
                          compress_ratios=CompressRatios.parse(ratios), qsa_budget=budget)
    with pytest.raises(ConfigError) as e:
        Engine.load(config)
    assert str(e.value) == message


def test_a_model_naming_qsa_layers_in_its_config_loads_with_those_layers(tiny_dirs, tmp_path):
    from engine.engine import Engine
    from engine.settings import EngineConfig
    path = copy_with(tiny_dirs["llama"], tmp_path / "m", compress_ratios=[0, 4, 4], qsa_budget=64)
    engine = Engine.load(EngineConfig(model=str(path), ctx_size=64))
    assert [spec.describe() for spec in engine.model.specs] == ["dense", "qsa r=4", "qsa r=4"]
    assert engine.cache.kpool[0] is None and engine.cache.kpool[1].shape == (1, 2, 64 // 4, 16)


def test_missing_tensor_is_named(tiny_dirs, tmp_path):
    path = copy_with(tiny_dirs["llama"], tmp_path / "m")
    shapes = shapes_of(path)
    del shapes["model.layers.1.mlp.up_proj.weight"]
    write_header_only(path, shapes)
    assert open_error(path, WeightsError) == \
        f"tensor model.layers.1.mlp.up_proj.weight: missing from {path} (expected shape [128, 64])"


def test_tensor_of_wrong_shape_is_named_with_both_shapes(tiny_dirs, tmp_path):
    path = copy_with(tiny_dirs["llama"], tmp_path / "m")
    write_header_only(path, {**shapes_of(path), "model.layers.0.self_attn.k_proj.weight": [64, 64]})
    assert open_error(path, WeightsError) == \
        "tensor model.layers.0.self_attn.k_proj.weight: expected shape [32, 64], found [64, 64]"


def test_tokenizer_larger_than_embedding_is_refused(tiny_dirs, tmp_path):
    # The tiny tokenizer has 259 tokens; an embedding of 258 rows cannot embed the last one.
    path = copy_with(tiny_dirs["llama"], tmp_path / "m", vocab_size=258)
    write_header_only(path, {**shapes_of(path), "model.embed_tokens.weight": [258, 64]})
    files = open_model(path)
    with pytest.raises(ConfigError) as e:
        Tokenizer.load(files)
    assert str(e.value) == "tokenizer vocabulary=259: larger than the embedding (vocab_size=258)"


def test_missing_path_is_refused(tmp_path):
    path = tmp_path / "nowhere"
    assert open_error(path) == f"model={str(path)!r}: path does not exist"


def test_directory_without_config_is_not_a_model(tmp_path):
    assert open_error(tmp_path) == f"model={str(tmp_path)!r}: not a model (directory without config.json)"


def test_directory_without_safetensors_is_not_a_model(tiny_dirs, tmp_path):
    path = copy_with(tiny_dirs["llama"], tmp_path / "m")
    (path / "model.safetensors").unlink()
    assert open_error(path) == f"model={str(path)!r}: not a model (no *.safetensors files)"


def test_plain_file_is_not_a_model(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("not weights")
    assert open_error(path) == f"model={str(path)!r}: not a model (expected an HF directory or a .gguf file)"


def test_opening_reads_headers_but_no_tensor_data(tiny_dirs, tmp_path):
    path = copy_with(tiny_dirs["llama"], tmp_path / "m")
    weights = path / "model.safetensors"
    (n,) = struct.unpack("<Q", weights.read_bytes()[:8])
    weights.write_bytes(weights.read_bytes()[:8 + n])  # valid header, every data byte cut off
    files = open_model(path)
    assert files.shapes == {name: tuple(shape) for name, shape in shapes_of(path).items()}
    # The data really is gone: reading it fails, so open_model above never did.
    with pytest.raises(SafetensorError):
        files.load_tensors()


def test_shape_error_needs_no_tensor_data(tiny_dirs, tmp_path):
    path = copy_with(tiny_dirs["llama"], tmp_path / "m")
    write_header_only(path, {**shapes_of(path), "model.norm.weight": [65]})
    assert open_error(path, WeightsError) == "tensor model.norm.weight: expected shape [64], found [65]"


def test_a_ratio_list_may_give_the_draft_layers_after_the_trunks(tiny_dirs):
    from engine.files.model_config import with_compression
    from engine.settings import CompressRatios
    config = open_model(tiny_dirs["llama"]).config  # three trunk layers
    target, draft = with_compression(config, CompressRatios.parse("0,4,0,4"), 8, draft_ratios=(0,))
    assert (target.layer_ratios, draft, target.qsa_budget) == ((0, 4, 0), (4,), 8)
    target, draft = with_compression(config, CompressRatios.parse("every2:4"), 8, draft_ratios=(0,))
    assert (target.layer_ratios, draft) == ((0, 4, 0), (0,))  # a pattern covers the trunk alone
