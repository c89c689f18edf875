"""GGUF's block formats (engine/ops/blocks.py): tandem's quantizer writes the blocks llama.cpp's reference
quantizer writes (the gguf package's, bit for bit), its dequantizer reads the numbers llama.cpp
reads, and a linear layer keeps a weight as the file stores it or quantizes it on load."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.ops import blocks
from engine.ops.blocks import BlockTensor, StackedBlocks
from engine.ops.quant import FormatUse, Linear, stored_format, weight_formats
from tests.engine.block_samples import READ_ONLY, sample_blocks

GGUF_TYPE = {"q4_0": gguf.GGMLQuantizationType.Q4_0, "q4_1": gguf.GGMLQuantizationType.Q4_1,
             "q5_0": gguf.GGMLQuantizationType.Q5_0, "q8_0": gguf.GGMLQuantizationType.Q8_0}


def fixed_tensor() -> torch.Tensor:
    """Random rows, and blocks that test the rule's edges: all zero (d = 0), constant, one spike of
    each sign, exact halves that roundf and trunc(x + 0.5) treat alike or not."""
    w = torch.randn(12, 128, generator=torch.Generator().manual_seed(7)) * 0.05
    w[0, :32] = 0
    w[1, :32] = 0.25
    w[2, :32], w[2, 5] = 0.01, -3.0
    w[3, :32], w[3, 9] = -0.01, 3.0
    w[4, :32] = torch.arange(32) / 2 - 8  # halves
    w[5, 32:64] = torch.linspace(-1, 1, 32)
    return w


@pytest.mark.parametrize("fmt", blocks.FORMATS)
def test_quantize_writes_llama_cpps_reference_blocks(fmt):
    w = fixed_tensor()
    reference = gguf.quants.quantize(w.numpy(), GGUF_TYPE[fmt])
    mine = blocks.quantize(w, fmt)
    assert mine.dtype == torch.uint8 and mine.shape == (12, 128 // 32 * blocks.BLOCK_BYTES[fmt])
    assert np.array_equal(mine.numpy(), reference)


@pytest.mark.parametrize("fmt", blocks.FORMATS)
def test_dequantize_reads_the_numbers_llama_cpp_reads(fmt):
    data = gguf.quants.quantize(fixed_tensor().numpy(), GGUF_TYPE[fmt])
    reference = gguf.quants.dequantize(data, GGUF_TYPE[fmt])
    assert np.array_equal(blocks.dequantize(torch.from_numpy(data), fmt, 128).numpy(), reference)


@pytest.mark.parametrize("fmt, steps", [("q8_0", 127), ("q4_0", 8), ("q4_1", 7.5), ("q5_0", 16)])
def test_each_weight_comes_back_within_one_step_of_its_block(fmt, steps):
    # One step: d, amax / 127, amax / 8 or / 16 (q4_0 and q5_0 clip +amax to 7 or 15 steps), or the range / 15.
    w = fixed_tensor()[6:].view(6, 4, 32)  # the random rows
    back = blocks.dequantize(blocks.quantize(w.reshape(6, 128), fmt), fmt, 128).view(6, 4, 32)
    step = w.abs().amax(-1) / steps
    assert ((back - w).abs().amax(-1) <= step * 1.01).all()


def test_stored_format_keeps_blocks_under_auto_and_falls_back_to_f32():
    q = BlockTensor("q4_1", blocks.quantize(torch.randn(8, 64), "q4_1"), 64)
    assert stored_format(q, "auto") == "q4_1"
    assert stored_format(torch.randn(8, 64), "auto") == "f32"  # an F32/F16 file, or an HF model
    assert stored_format(torch.randn(8, 64), "q4_0") == "q4_0"  # quantized on load
    assert stored_format(torch.randn(8, 48), "q8_0") == "f32"  # rows are not whole blocks
    assert stored_format(q, "int8") == "int8"


def test_a_linear_layer_keeps_the_files_blocks_and_serves_their_rows():
    w = fixed_tensor()
    data = blocks.quantize(w, "q4_1")
    layer = Linear(BlockTensor("q4_1", data, 128), None, "auto")
    assert layer.weight.data_ptr() == data.data_ptr() or torch.equal(layer.weight, data)  # no f32 copy
    assert layer.weight.dtype == torch.uint8 and layer.dtype == "q4_1"
    ids = torch.tensor([[3, 0], [11, 3]])
    assert torch.equal(layer.rows(ids), blocks.dequantize(data, "q4_1", 128)[ids])


@pytest.mark.parametrize("fmt", READ_ONLY)
def test_a_linear_layer_reads_the_formats_files_hold_as_stored(fmt):
    data = sample_blocks(fmt, 8, 512)
    layer = Linear(BlockTensor(fmt, data, 512), None, "auto")
    assert layer.dtype == fmt and layer.weight.data_ptr() == data.data_ptr()  # the file's bytes, no copy
    w = blocks.dequantize(data, fmt, 512)
    ids = torch.tensor([[3, 0], [7, 3]])
    assert torch.equal(layer.rows(ids), w[ids])
    for rows in (3, 40):  # the kernel's rows, and past them torch's matmul on the dequantized weight
        x = torch.randn(rows, 512)
        assert torch.allclose(layer(x), x @ w.T, rtol=1e-4, atol=1e-4)
    assert {f: u.nbytes for f, u in weight_formats(layer).items()} == {fmt: data.nbytes}


def test_quantize_on_load_and_fused_rows():
    w = fixed_tensor()
    parts = [BlockTensor("q8_0", blocks.quantize(w[:4], "q8_0"), 128),
             BlockTensor("q8_0", blocks.quantize(w[4:], "q8_0"), 128)]
    fused = blocks.cat_rows(parts)
    assert isinstance(fused, BlockTensor) and torch.equal(fused.data, blocks.quantize(w, "q8_0"))
    mixed = blocks.cat_rows([parts[0], w[4:]])  # blocks beside a plain weight: f32
    assert torch.equal(mixed, torch.cat([parts[0].dequantize(), w[4:]]))
    layer = Linear(w, None, "q4_0", parts=2)
    assert torch.equal(layer.weight, blocks.quantize(w, "q4_0"))
    assert {f: u.tensors for f, u in weight_formats(layer).items()} == {"q4_0": 2}
    assert weight_formats(layer)["q4_0"].nbytes == 12 * 4 * 18


def test_a_fused_projection_keeps_each_parts_format():
    # A Q4_K_M file holds q and k in Q4_K and v in Q6_K (or Q5_0 and Q8_0 at 576-wide rows): the fused
    # qkv keeps the file's bytes, runs of one format merged, and multiplies each part as it is.
    shapes = [("q4_k", 8), ("q4_k", 4), ("q6_k", 4), ("q5_0", 3)]
    parts = [BlockTensor(f, sample_blocks(f, rows, 512, seed=i), 512) for i, (f, rows) in enumerate(shapes)]
    stacked = blocks.cat_rows(parts)
    assert isinstance(stacked, StackedBlocks) and [p.format for p in stacked.parts] == ["q4_k", "q6_k", "q5_0"]
    w = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(stacked.dequantize(), w)
    layer = Linear(stacked, None, "auto", parts=3)
    assert layer.weight.nbytes == sum(p.data.nbytes for p in parts)  # not a byte more than the file's
    assert {f: u.nbytes for f, u in weight_formats(layer).items()} == \
        {"q4_k": 12 * 2 * 144, "q6_k": 4 * 2 * 210, "q5_0": 3 * 16 * 22}
    with torch.inference_mode():  # the kernels serve inference
        for rows in (1, 5, 40):  # the kernel's rows, and past them torch's matmul on the dequantized weight
            x = torch.randn(rows, 512)
            assert torch.allclose(layer(x), x @ w.T, rtol=1e-4, atol=1e-4)
    assert torch.equal(Linear(stacked, None, "q8_0").weight, blocks.quantize(w, "q8_0"))  # quantized on load
    biased = Linear(stacked, torch.randn(19), "auto", parts=3)  # q, k and v with their biases (Qwen2)
    assert weight_formats(biased)["f32"] == FormatUse(3, 19 * 4)
