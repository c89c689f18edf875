"""A GGUF file in each weight type tandem promises (Q4_0, Q4_1, Q5_0, Q8_0, F16, F32) gives transformers'
logits for the same file, through chunked prefill and decode: tandem dequantizes every type the
way the reference reads it, and undoes llama.cpp's q/k row order. The files are written here, as
llama.cpp's converter lays them out, from a tiny random Llama."""
from __future__ import annotations

import functools
import math

import gguf
import numpy as np
import pytest
import torch

from engine.cli.tiny import BOS_ID, EOS_ID, hf_config, random_tensors, tensor_shapes
from engine.files.weights import _GGUF_GLOBAL_NAMES, _GGUF_LAYER_NAMES, hf_name_of_gguf, open_model
from engine.model.transformer import Transformer
from tests.engine.test_parity import (MAX_POSITIONS, PROMPT_LEN, ROPE_CASES, TOLERANCE, assert_matches,
                                      engine_logits, greedy_reference, load_engine_model, tiny_config)

Q = gguf.GGMLQuantizationType
TYPES = {"Q4_0": Q.Q4_0, "Q4_1": Q.Q4_1, "Q5_0": Q.Q5_0, "Q8_0": Q.Q8_0, "F16": Q.F16, "F32": Q.F32}
CONFIG = tiny_config("llama")


def gguf_names(num_layers: int) -> dict[str, str]:
    """HF tensor name -> GGUF name: the inverse of the map tandem reads GGUF files with."""
    names = [*_GGUF_GLOBAL_NAMES, *(f"blk.{i}.{n}" for i in range(num_layers) for n in _GGUF_LAYER_NAMES)]
    return {hf_name_of_gguf(name, "llama", num_layers): name for name in names}


def llama_cpp_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's converter interleaves the two RoPE halves of each q/k head."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rope: dict, head_dim: int) -> list[float]:
    """What llama.cpp's converter writes as `rope_freqs.weight` for Llama 3's scaling: each
    frequency's divisor (1 for short wavelengths, the factor for long ones, a blend between)."""
    factor, low, high, context = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"], \
        rope["original_max_position_embeddings"]
    out = []
    for i in range(0, head_dim, 2):
        wavelength = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelength < context / high:
            out.append(1.0)
        elif wavelength > context / low:
            out.append(factor)
        else:
            smooth = (context / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def write_gguf(path, weight_type: gguf.GGMLQuantizationType, seed: int = 0, compress_ratios: list[int] | None = None,
               qsa_budget: int | None = None, config: dict = CONFIG, split_max_tensors: int = 0) -> None:
    """compress_ratios, qsa_budget: tandem's own metadata keys, written when given. A config with
    Llama 3's RoPE scaling gets the converter's `rope_freqs.weight` (and no rope.scaling keys).
    split_max_tensors: a model split in parts of that many tensors, named as llama.cpp names them
    (`path` without .gguf, then -0000N-of-0000M.gguf)."""
    hf = hf_config(config)
    writer = gguf.GGUFWriter(str(path), "llama", split_max_tensors=split_max_tensors)
    writer.add_context_length(MAX_POSITIONS)
    writer.add_embedding_length(hf.hidden_size)
    writer.add_block_count(hf.num_hidden_layers)
    writer.add_feed_forward_length(hf.intermediate_size)
    writer.add_head_count(hf.num_attention_heads)
    writer.add_head_count_kv(hf.num_key_value_heads)
    writer.add_rope_freq_base(hf.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(hf.rms_norm_eps)
    writer.add_vocab_size(hf.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"<t{i}>" for i in range(hf.vocab_size)])
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    if compress_ratios is not None:
        writer.add_array("llama.attention.compress_ratios", compress_ratios)
    if qsa_budget is not None:
        writer.add_uint32("llama.attention.qsa_budget", qsa_budget)
    if hf.rope_parameters.get("rope_type") == "llama3":
        factors = llama3_rope_factors(hf.rope_parameters, hf.hidden_size // hf.num_attention_heads)
        writer.add_tensor("rope_freqs.weight", np.array(factors, dtype=np.float32))
    names = gguf_names(hf.num_hidden_layers)
    for name, tensor in random_tensors(tensor_shapes(hf), seed).items():
        w = tensor.numpy()
        if name.endswith("q_proj.weight"):
            w = llama_cpp_rows(w, hf.num_attention_heads)
        elif name.endswith("k_proj.weight"):
            w = llama_cpp_rows(w, hf.num_key_value_heads)
        kind = Q.F32 if w.ndim == 1 else weight_type  # llama.cpp keeps norms in F32 whatever the type
        writer.add_tensor(names[name], gguf.quants.quantize(w, kind), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """reference(type) -> (GGUF path, prompt then transformers' greedy continuation, its logits)."""
    from transformers import AutoModelForCausalLM

    @functools.cache
    def make(type_name: str):
        path = tmp_path_factory.mktemp(type_name) / f"tiny-{type_name}.gguf"
        write_gguf(path, TYPES[type_name])
        hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32,
                                                  attn_implementation="eager").eval()
        return path, *greedy_reference(hf, CONFIG["vocab_size"])

    return make


@pytest.mark.parametrize("type_name", TYPES)
def test_each_weight_type_matches_transformers(reference, type_name):
    path, tokens, logits = reference(type_name)
    reader = gguf.GGUFReader(str(path))
    assert {t.tensor_type for t in reader.tensors if len(t.shape) > 1} == {TYPES[type_name]}
    files = open_model(path)
    assert files.format == "gguf" and files.config.num_layers == CONFIG["num_hidden_layers"]
    assert_matches(engine_logits(load_engine_model(path), tokens), logits)


@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
def test_each_block_type_served_as_stored_matches_transformers(reference, type_name):
    # --dtype auto: the matrices stay the file's blocks, and the kernels widen them to the numbers
    # transformers reads, so the logits match as the f32 path's do.
    path, tokens, logits = reference(type_name)
    files = open_model(path)
    model = Transformer(files.config, files.load_tensors(keep_blocks=True), dtype="auto", max_positions=MAX_POSITIONS)
    assert {layer.self_attn.qkv_proj.dtype for layer in model.layers} == {type_name.lower()}
    assert model.lm_head.weight.dtype == torch.uint8
    assert_matches(engine_logits(model, tokens), logits)


def test_the_types_really_differ(reference):
    # Same random weights in every file: if quantization were skipped somewhere, Q4_0 and F32 would
    # agree, and the parity above would not show that each type's blocks are read right.
    q4, f32 = reference("Q4_0")[2], reference("F32")[2]
    assert (q4[:PROMPT_LEN] - f32[:PROMPT_LEN]).abs().max() > 10 * TOLERANCE


def test_a_gguf_file_opened_from_its_saved_index_reads_as_parsed_and_a_changed_file_is_parsed_again(tmp_path,
                                                                                                     monkeypatch):
    from engine.files import weights
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_gguf(path, Q.Q4_1)

    def opened():
        weights._open_gguf_version.cache_clear()  # as a new process would
        files = weights.open_model(str(path))
        return files, files.load_tensors(keep_blocks=True)
    parsed, parsed_tensors = opened()
    saved = list((tmp_path / "cache" / "tandem" / "gguf").glob("*.json"))
    assert len(saved) == 1
    read, read_tensors = opened()
    assert (read.config, read.shapes, read.stored) == (parsed.config, parsed.shapes, parsed.stored)
    assert read_tensors.keys() == parsed_tensors.keys()
    for name, t in parsed_tensors.items():
        assert torch.equal(getattr(t, "data", t), getattr(read_tensors[name], "data", read_tensors[name])), name
    write_gguf(path, Q.Q4_1, seed=1)  # another file at the same path: its own index
    changed, changed_tensors = opened()
    assert len(list(saved[0].parent.glob("*.json"))) == 2
    assert not torch.equal(changed_tensors["model.norm.weight"], parsed_tensors["model.norm.weight"])


def test_a_llama_3_file_reads_its_rope_factors_and_matches_transformers_with_the_same_scaling(tmp_path, reference):
    # Llama 3.1/3.2 files carry their RoPE scaling only as rope_freqs.weight: the same weights as an
    # HF checkpoint with rope_type llama3 give that checkpoint's logits in transformers.
    from transformers import AutoModelForCausalLM
    from engine.cli.tiny import write_tiny_model
    config = ROPE_CASES["rope_llama3"].config
    path = tmp_path / "llama3.gguf"
    write_gguf(path, Q.F32, config=config)
    files = open_model(path)
    assert files.config.rope.kind == "default" and len(files.config.rope.freq_factors) == files.config.rotary_dim // 2
    assert max(files.config.rope.freq_factors) == config["rope_parameters"]["factor"]
    hf = AutoModelForCausalLM.from_pretrained(str(write_tiny_model(config, tmp_path / "hf")), dtype=torch.float32,
                                              attn_implementation="eager").eval()
    tokens, logits = greedy_reference(hf, CONFIG["vocab_size"])
    assert_matches(engine_logits(load_engine_model(path), tokens), logits)
    # Without the factors (the file as the plain rule reads it) the positions past the short
    # wavelengths differ: the test above would see a file whose factors were dropped.
    assert (engine_logits(load_engine_model(reference("F32")[0]), tokens) - logits).abs().max() > 10 * TOLERANCE


def test_rope_factors_of_the_wrong_count_are_refused_naming_the_tensor(tmp_path):
    import dataclasses
    from engine.errors import ConfigError
    path = tmp_path / "llama3.gguf"
    write_gguf(path, Q.F32, config=ROPE_CASES["rope_llama3"].config)
    config = open_model(path).config
    with pytest.raises(ConfigError, match=r"rope_freqs.weight: must hold 8 positive factors .* found 3"):
        dataclasses.replace(config, rope=dataclasses.replace(config.rope, freq_factors=(1.0, 2.0, 4.0)))


def test_a_split_file_opened_by_its_first_part_reads_the_tensors_of_the_whole_file(tmp_path, reference):
    from engine.errors import ConfigError
    whole_path = reference("Q8_0")[0]
    write_gguf(tmp_path / "tiny", Q.Q8_0, split_max_tensors=7)
    parts = sorted(tmp_path.glob("tiny-*-of-*.gguf"))
    assert len(parts) >= 3 and parts[0].name.endswith("-00001-of-" + parts[0].name[-10:])
    split, whole = open_model(parts[0]), open_model(whole_path)
    assert (split.config, split.shapes, split.stored) == (whole.config, whole.shapes, whole.stored)
    got, expected = split.load_tensors(keep_blocks=True), whole.load_tensors(keep_blocks=True)
    assert got.keys() == expected.keys()
    for name, t in expected.items():
        assert torch.equal(getattr(got[name], "data", got[name]), getattr(t, "data", t)), name
    with pytest.raises(ConfigError, match=r"part 2 of a model split in \d+ parts \(split.no=1\); open it by its "
                                          r"first part, tiny-00001-of-"):
        open_model(parts[1])
    parts[-1].unlink()
    from engine.files import weights
    weights._open_gguf_version.cache_clear()
    with pytest.raises(ConfigError, match=rf"part {len(parts)} of {len(parts)}, {parts[-1].name}, is missing beside it"):
        open_model(parts[0])
