"""GGUF's block formats: weights as the file stores them.

Each row of a weight [N, K] is K / 32 blocks of 32 consecutive input weights, one after another
(GGUF's layout, little-endian), so a row's bytes are K / 32 * BLOCK_BYTES[format]:

    q8_0  34 bytes: f16 d, 32 x int8 q                             w = d * q
    q4_0  18 bytes: f16 d, 16 bytes of 4-bit q                     w = d * (q - 8)
    q4_1  20 bytes: f16 d, f16 m, 16 bytes of 4-bit q              w = d * q + m
    q5_0  22 bytes: f16 d, 4 bytes qh, 16 bytes of 4-bit q         w = d * (q - 16)
    q5_1  24 bytes: f16 d, f16 m, 4 bytes qh, 16 bytes of 4-bit q  w = d * q + m

In a 4-bit block byte j holds weight j in its low nibble and weight j + 16 in its high one; a 5-bit
weight's fifth bit is bit j of qh (a little-endian 32-bit word) for weight j.

The K-quants hold rows of super-blocks of 256 weights (SUPER_BYTES; the kernels read them as
[N, K / 256, bytes], kernel_view): q4_k and q5_k 8 sub-blocks of 32, w = d * sc_j * q - dmin * m_j
with 6-bit sc_j, m_j (q5_k: a fifth bit per weight); q6_k 16 sub-blocks of 16, w = d * sc_j * (q - 32)
with int8 sc_j (engine/ops/csrc/kquants.cpp has the byte layouts).

`dequantize` computes w exactly as llama.cpp (and the gguf package) do, in f32, so a block weight
widened in tandem's kernels is the same number the f32 path reads. `quantize` is llama.cpp's
reference quantizer (ggml-quants.c, quantize_row_*_ref), written from its definition, for the
formats tandem quantizes to (FORMATS, the --dtype choices); the others are read as files hold them.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

BLOCK = 32  # weights per block, along the input dimension
BLOCK_BYTES = {"q4_0": 18, "q4_1": 20, "q5_0": 22, "q5_1": 24, "q8_0": 34}
SUPER_BLOCK = 256  # weights per K-quant super-block
SUPER_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}
FORMATS = ("q4_0", "q4_1", "q5_0", "q8_0")  # those tandem quantizes weights to
SERVED = (*BLOCK_BYTES, *SUPER_BYTES)  # every block format the kernels read as stored
# GGUF's tensor type numbers (ggml_type) of the block formats.
GGUF_TYPES = {2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0", 12: "q4_k", 13: "q5_k", 14: "q6_k"}
_GGUF_TYPE_OF = {fmt: kind for kind, fmt in GGUF_TYPES.items()}
# GGUF's unquantized types: a matrix in one of these is f32 under "auto", as chosen, not a fallback.
GGUF_PLAIN_TYPES = {0: "F32", 1: "F16", 30: "BF16"}


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


STACKED = "stacked"  # the format name of a StackedBlocks weight


@dataclass(frozen=True)
class StackedBlocks:
    """Block weights stacked along their rows, each part in its own format (cat_rows). The kernels
    take it as its parts' bytes one after another, uint8 [total], with its layout: int64 [parts, 2],
    each part's rows and bytes per block (engine/ops/csrc/tandem.h)."""
    parts: tuple[BlockTensor, ...]
    format = STACKED

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].cols

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def bytes(self) -> torch.Tensor:
        return torch.cat([p.data.reshape(-1) for p in self.parts])

    def layout(self) -> torch.Tensor:
        return torch.tensor([[p.shape[0], block_bytes(p.format)] for p in self.parts], dtype=torch.int64)


def block_bytes(fmt: str) -> int:
    """Bytes per block (per super-block of a K-quant): with the row width they name the format."""
    return SUPER_BYTES.get(fmt) or BLOCK_BYTES[fmt]


def unstack(data: torch.Tensor, layout: torch.Tensor, cols: int) -> list[BlockTensor]:
    """A stacked weight's bytes and layout (StackedBlocks.bytes, layout) -> its parts."""
    formats = {block_bytes(f): f for f in SERVED}
    parts, start = [], 0
    for rows, size in layout.tolist():
        fmt = formats[size]
        row = cols * size // (SUPER_BLOCK if fmt in SUPER_BYTES else BLOCK)
        parts.append(BlockTensor(fmt, data[start:start + rows * row].view(rows, row), cols))
        start += rows * row
    return parts


def fits(weight_shape: tuple[int, ...]) -> bool:
    """Whether a block format can hold a weight of this shape: a matrix whose rows are whole blocks."""
    return len(weight_shape) == 2 and weight_shape[1] % BLOCK == 0


def bytes_per_weight(fmt: str) -> float:
    return SUPER_BYTES[fmt] / SUPER_BLOCK if fmt in SUPER_BYTES else BLOCK_BYTES[fmt] / BLOCK


def kernel_view(data: torch.Tensor, fmt: str, cols: int) -> torch.Tensor:
    """Block rows [N, bytes] as the kernels take them: a K-quant's [N, cols / 256, super-block bytes],
    the others' as they are (engine/ops/csrc/tandem.h: the shape names the format)."""
    return data.view(data.shape[0], cols // SUPER_BLOCK, SUPER_BYTES[fmt]) if fmt in SUPER_BYTES else data


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """[..., 2] uint8 -> [..., 1] f32."""
    return raw.contiguous().view(torch.float16).float()


def dequantize(data: torch.Tensor, fmt: str, cols: int) -> torch.Tensor:
    """uint8 block rows [rows, ...] (as stored, or kernel_view's) -> f32 [rows, cols] on data's device."""
    if fmt not in FORMATS:  # read only: the gguf package's dequantization, llama.cpp's numbers
        import gguf
        rows = data.shape[0]
        w = gguf.quants.dequantize(data.reshape(rows, -1).cpu().numpy(), _GGUF_TYPE_OF[fmt]).reshape(rows, cols)
        return torch.from_numpy(w).to(data.device)
    b = data.view(data.shape[0], cols // BLOCK, BLOCK_BYTES[fmt])
    d = _f16(b[..., :2])
    if fmt == "q8_0":
        w = d * b[..., 2:].contiguous().view(torch.int8).float()
    elif fmt == "q4_1":
        w = d * _q4(b[..., 4:]).float() + _f16(b[..., 2:4])
    else:
        w = d * _centred(b, fmt).float()
    return w.reshape(data.shape[0], cols)


def _q4(qs: torch.Tensor) -> torch.Tensor:
    """16 bytes of nibbles [..., 16] -> the 32 4-bit q [..., 32]."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _centred(b: torch.Tensor, fmt: str) -> torch.Tensor:
    """q4_0 or q5_0 blocks [..., bytes] -> their q - 8 or q - 16 [..., 32], int32."""
    return _q4(b[..., 2:]).to(torch.int32) - 8 if fmt == "q4_0" else _q5(b) - 16


_BITS = torch.arange(BLOCK, dtype=torch.int32)


def _q5(b: torch.Tensor) -> torch.Tensor:
    """q5_0 blocks [..., 22] -> their 5-bit q [..., 32] (int32)."""
    qs = b[..., 6:].to(torch.int32)
    qh = b[..., 2:6].to(torch.int32)
    high = qh[..., 0:1] | (qh[..., 1:2] << 8) | (qh[..., 2:3] << 16) | (qh[..., 3:4] << 24)
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1) | (((high >> _BITS) & 1) << 4)


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
    q5_0: d = x_m / -16 for x_m the value of largest magnitude, q = min(31, trunc(x / d + 16.5))

    with 1 / d taken once per block (0 when d is 0) and d, m stored as f16."""
    rows, cols = w.shape
    x = w.float().reshape(rows, cols // BLOCK, BLOCK)
    if fmt == "q8_0":
        d = x.abs().amax(-1, keepdim=True) / 127
        q = _roundf(x * _reciprocal(d)).to(torch.int8).view(torch.uint8)
        return torch.cat([_as_f16_bytes(d), q], -1).reshape(rows, -1)
    if fmt in ("q4_0", "q5_0"):
        levels = 16 if fmt == "q4_0" else 32
        d = x.gather(-1, x.abs().argmax(-1, keepdim=True)) / -(levels // 2)
        q = (x * _reciprocal(d) + levels // 2 + 0.5).trunc().clamp(0, levels - 1).to(torch.int32)
        header = _as_f16_bytes(d)
        if fmt == "q5_0":
            high = ((q >> 4) << _BITS).sum(-1, keepdim=True)  # the fifth bits as one 32-bit word
            header = torch.cat([header, torch.stack([(high >> s) & 0xFF for s in (0, 8, 16, 24)], -1)
                                .reshape(*high.shape[:-1], 4).to(torch.uint8)], -1)
            q = q & 0x0F
        q = q.to(torch.uint8)
    else:
        lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
        d = (hi - lo) / 15
        q = ((x - lo) * _reciprocal(d) + 0.5).trunc().clamp(0, 15).to(torch.uint8)
        header = torch.cat([_as_f16_bytes(d), _as_f16_bytes(lo)], -1)
    packed = q[..., :BLOCK // 2] | (q[..., BLOCK // 2:] << 4)
    return torch.cat([header, packed], -1).reshape(rows, -1).contiguous()


def to_f32(weight: torch.Tensor | BlockTensor | StackedBlocks) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, (BlockTensor, StackedBlocks)) else weight.float()


def take_rows(weight: torch.Tensor | BlockTensor, index: torch.Tensor) -> torch.Tensor | BlockTensor:
    """The weight's rows `index`, in order; a block weight's stay blocks (a row is whole blocks)."""
    return weight.rows(index) if isinstance(weight, BlockTensor) else weight[index]


def cat_rows(parts: list[torch.Tensor | BlockTensor]) -> torch.Tensor | BlockTensor | StackedBlocks:
    """Weights stacked along their rows (fused projections): blocks of one format stay blocks; blocks
    of several formats (a Q4_K_M file's Q4_K q and k beside a Q6_K v) stay each in its own, as a
    StackedBlocks of the runs of one format; a mix with plain weights becomes f32."""
    if not all(isinstance(p, BlockTensor) for p in parts):
        return torch.cat([to_f32(p) for p in parts])
    cols = parts[0].cols
    merged = [BlockTensor(fmt, torch.cat([p.data for p in run]), cols)
              for fmt, run in itertools.groupby(parts, key=lambda p: p.format)]
    return merged[0] if len(merged) == 1 else StackedBlocks(tuple(merged))
