"""A GGUF file's block types the kernels do not read load in the nearest format they do
(engine/files/nearest_format.py): Q4_K's sub-blocks as q4_1 blocks, whose weights move by at most the
f16 rounding of each sub-block's scale and minimum; every other type as q8_0, within a q8_0 step of
llama.cpp's dequantized weights. The blocks are random bytes (any bytes are valid blocks) with
finite f16 scales."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from engine.files.nearest_format import convert, served, served_bytes
from engine.ops import blocks

Q = gguf.GGMLQuantizationType
ROWS, COLS = 6, 512


def random_blocks(kind: Q, scales: list[int]) -> np.ndarray:
    """Random rows of `kind`'s blocks, the f16 values at byte offsets `scales` of each block set to
    small positive numbers."""
    per, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(int(kind))
    data = rng.integers(0, 256, (ROWS * COLS // per, size), dtype=np.uint8)
    for offset in scales:
        data[:, offset:offset + 2] = rng.uniform(0.001, 0.05, (len(data), 1)).astype(np.float16).view(np.uint8)
    return data.reshape(ROWS, -1)


def test_q4_k_loads_as_q4_1_moving_each_weight_by_the_f16_rounding_of_its_scale_and_minimum():
    data = random_blocks(Q.Q4_K, [0, 2])
    reference = torch.from_numpy(gguf.quants.dequantize(data, Q.Q4_K))
    got = blocks.dequantize(convert(data, Q.Q4_K, ROWS, COLS), "q4_1", COLS)
    # d * sc and dmin * m are at most 63 times a 0.05 f16: each rounds by 2^-11 of itself at most,
    # and q <= 15 multiplies the scale's.
    bound = (15 + 1) * 63 * 0.05 * 2 ** -11
    assert (got - reference).abs().max() <= bound
    assert not torch.equal(got, torch.zeros_like(got)) and (got == reference).float().mean() > 0.01


@pytest.mark.parametrize("kind, scales", [(Q.Q6_K, [208]), (Q.Q5_K, [0, 2]), (Q.Q5_1, [0, 2]), (Q.IQ4_NL, [0])])
def test_other_types_load_as_q8_0_within_a_step(kind, scales):
    data = random_blocks(kind, scales)
    reference = torch.from_numpy(gguf.quants.dequantize(data, kind)).reshape(ROWS, COLS)
    got = blocks.dequantize(convert(data, kind, ROWS, COLS), "q8_0", COLS)
    step = reference.view(ROWS, -1, 32).abs().amax(-1, keepdim=True) / 127
    # Half a step of rounding, and the f16 rounding of the step itself (2^-11) over up to 127 steps.
    assert ((got - reference).view(ROWS, -1, 32).abs() <= step * (0.5 + 127 * 2 ** -11) * 1.001).all()


def test_served_formats_and_their_bytes():
    assert [served(k, (8, 256)) for k in (Q.Q4_0, Q.Q5_0, Q.Q4_K, Q.Q6_K, Q.IQ2_XXS, Q.F16)] == \
        ["q4_0", "q5_0", "q4_1", "q8_0", "q8_0", None]
    assert served(Q.Q5_0, (8, 48)) is None and served(Q.Q4_K, (256,)) is None  # not whole blocks; a vector
    assert served_bytes(Q.Q4_K, (8, 256), 8 * 144) == 8 * 8 * 20
    assert served_bytes(Q.Q5_0, (8, 256), 8 * 8 * 22) == 8 * 8 * 22


def test_a_mix_of_block_formats_fuses_as_q8_0():
    w = torch.randn(12, 64)
    parts = [blocks.BlockTensor(f, blocks.quantize(w[4 * i:4 * i + 4], f), 64) for i, f in enumerate(("q5_0", "q4_0", "q8_0"))]
    fused = blocks.cat_rows(parts)
    assert isinstance(fused, blocks.BlockTensor) and fused.format == "q8_0"
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    # q8_0 cannot hold q4_1's minimum: its rows are quantized to q8_0 (as a Q4_K_M file's Q4_K q and k
    # beside a Q6_K v), within a q8_0 step, not widened to f32.
    q4_1 = blocks.BlockTensor("q4_1", blocks.quantize(w[:4], "q4_1"), 64)
    mixed = blocks.cat_rows([parts[0], q4_1])
    assert mixed.format == "q8_0" and torch.equal(mixed.dequantize()[:4], parts[0].dequantize())
    assert torch.equal(mixed.data[4:], blocks.quantize(q4_1.dequantize(), "q8_0"))
    assert blocks.cat_rows([parts[0], w[:4]]).dtype == torch.float32  # beside a plain weight
