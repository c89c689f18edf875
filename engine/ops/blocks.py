"""GGUF's block formats Q4_0, Q4_1 and Q8_0: weights as the file stores them.

Each row of a weight [N, K] is K / 32 blocks of 32 consecutive input weights, one after another
(GGUF's layout, little-endian), so a row's bytes are K / 32 * BLOCK_BYTES[format]:

    q8_0  34 bytes: f16 d, 32 x int8 q                      w = d * q
    q4_0  18 bytes: f16 d, 16 bytes of 4-bit q              w = d * (q - 8)
    q4_1  20 bytes: f16 d, f16 m, 16 bytes of 4-bit q       w = d * q + m

In a 4-bit block byte j holds weight j in its low nibble and weight j + 16 in its high one.
`dequantize` computes w exactly as llama.cpp (and the gguf package) do, in f32, so a block weight
widened in tandem's kernels is the same number the f32 path reads. `quantize` is llama.cpp's
reference quantizer (ggml-quants.c, quantize_row_*_ref), written from its definition.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block, along the input dimension
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q8_0": 34}
FORMATS = tuple(BLOCK_BYTES)
# GGUF's tensor type numbers (ggml_type) of the block formats.
GGUF_TYPES = {2: "q4_0", 3: "q4_1", 8: "q8_0"}


@dataclass(frozen=True)
class BlockTensor:
    """A weight [rows, cols] in a block format: `data` is uint8 [rows, cols / 32 * BLOCK_BYTES]."""
    format: str
    data: torch.Tensor
    cols: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.cols

    def rows(self, index) -> "BlockTensor":
        return BlockTensor(self.format, self.data[index], self.cols)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.data, self.format, self.cols)


def fits(weight_shape: tuple[int, ...]) -> bool:
    """Whether a block format can hold a weight of this shape: a matrix whose rows are whole blocks."""
    return len(weight_shape) == 2 and weight_shape[1] % BLOCK == 0


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [..., 1] f32."""
    return raw.contiguous().view(torch.float16).float()


def dequantize(data: torch.Tensor, fmt: str, cols: int) -> torch.Tensor:
    """uint8 [rows, cols / 32 * BLOCK_BYTES[fmt]] -> f32 [rows, cols]."""
    b = data.view(data.shape[0], cols // BLOCK, BLOCK_BYTES[fmt])
    d = _f16(b[..., :2])
    if fmt == "q8_0":
        w = d * b[..., 2:].contiguous().view(torch.int8).float()
    else:
        qs = b[..., 4:] if fmt == "q4_1" else b[..., 2:]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1)
        w = d * (q.to(torch.int8) - 8).float() if fmt == "q4_0" else d * q.float() + _f16(b[..., 2:4])
    return w.reshape(data.shape[0], cols)


def _roundf(v: torch.Tensor) -> torch.Tensor:
    # C's roundf (halves away from zero), computed as ggml does: no rounding of v + 0.5 on the way.
    a = v.abs()
    floored = a.floor()
    return v.sign() * (floored + (2 * (a - floored)).floor())


def _reciprocal(d: torch.Tensor) -> torch.Tensor:
    return torch.where(d == 0, torch.zeros_like(d), 1 / d)


def _as_f16_bytes(v: torch.Tensor) -> torch.Tensor:
    return v.to(torch.float16).view(torch.uint8)


def quantize(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """f32 [rows, cols] (cols a multiple of 32) -> uint8 blocks, as llama.cpp's reference rule:

    q8_0: d = max|x| / 127, q = roundf(x / d)
    q4_0: d = x_m / -8 for x_m the value of largest magnitude, q = min(15, trunc(x / d + 8.5))
    q4_1: d = (max - min) / 15, m = min, q = min(15, trunc((x - m) / d + 0.5))

    with 1 / d taken once per block (0 when d is 0) and d, m stored as f16."""
    rows, cols = w.shape
    x = w.float().reshape(rows, cols // BLOCK, BLOCK)
    if fmt == "q8_0":
        d = x.abs().amax(-1, keepdim=True) / 127
        q = _roundf(x * _reciprocal(d)).to(torch.int8).view(torch.uint8)
        return torch.cat([_as_f16_bytes(d), q], -1).reshape(rows, -1)
    if fmt == "q4_0":
        d = x.gather(-1, x.abs().argmax(-1, keepdim=True)) / -8
        q = (x * _reciprocal(d) + 8.5).trunc().clamp(0, 15).to(torch.uint8)
        header = _as_f16_bytes(d)
    else:
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        q = ((x - lo) * _reciprocal(d) + 0.5).trunc().clamp(0, 15).to(torch.uint8)
        header = torch.cat([_as_f16_bytes(d), _as_f16_bytes(lo)], -1)
    packed = q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
    return torch.cat([header, packed], -1).reshape(rows, -1).contiguous()


def to_f32(weight: torch.Tensor | BlockTensor) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, BlockTensor) else weight.float()


def take_rows(weight: torch.Tensor | BlockTensor, index: torch.Tensor) -> torch.Tensor | BlockTensor:
    """The weight's rows `index`, in order; a block weight's stay blocks (a row is whole blocks)."""
    return weight.rows(index) if isinstance(weight, BlockTensor) else weight[index]


def cat_rows(parts: list[torch.Tensor | BlockTensor]) -> torch.Tensor | BlockTensor:
    """Weights stacked along their rows (fused projections): blocks of one format stay blocks; a
    mix of formats becomes f32."""
    first = parts[0]
    if isinstance(first, BlockTensor) and all(isinstance(p, BlockTensor) and p.format == first.format for p in parts):
        return BlockTensor(first.format, torch.cat([p.data for p in parts]), first.cols)
    return torch.cat([to_f32(p) for p in parts])
