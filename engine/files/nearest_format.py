"""A GGUF file's block types that tandem's kernels do not read, in the nearest format they do,
converted once at load (under `--dtype auto`, and wherever a file's blocks are kept).

Q4_K's sub-blocks of 32 weights are Q4_1 blocks in all but storage: llama.cpp computes
w = d * sc_j * q - dmin * m_j, q 4-bit, with d, dmin f16 per 256 weights and sc_j, m_j 6-bit per 32.
Each sub-block becomes a q4_1 block with scale d * sc_j and minimum -(dmin * m_j), rounded to f16:
the nibbles are kept, and a weight moves by at most 2^-11 of its sub-block's scale and minimum.
Every other type (Q5_1, Q5_K, Q6_K, Q2_K, Q3_K, the IQ types) is dequantized as llama.cpp does and
quantized to q8_0 by llama.cpp's reference rule: one step of max|w| / 127 per block of 32.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from engine.ops import blocks

Q4_K, Q4_K_BYTES = 12, 144  # ggml_type, bytes per 256 weights


def served(kind: int | None, shape: tuple[int, ...]) -> str | None:
    """The block format a GGUF tensor of type `kind` and (HF) shape loads in where blocks are kept:
    its own, the nearest, or None (f32) for a plain type, a vector, or rows that are not whole blocks."""
    if kind is None or kind in blocks.GGUF_PLAIN_TYPES or len(shape) not in (2, 3) or shape[-1] % blocks.BLOCK:
        return None
    return blocks.GGUF_TYPES.get(kind) or ("q4_1" if kind == Q4_K else "q8_0")


def served_bytes(kind: int, shape: tuple[int, ...], stored: int) -> int:
    """The bytes such a tensor (`stored` in the file) takes once loaded as served() says."""
    fmt = served(kind, shape)
    return stored if fmt is None or kind in blocks.GGUF_TYPES else math.prod(shape) // blocks.BLOCK * blocks.BLOCK_BYTES[fmt]


def convert(data: np.ndarray, kind, rows: int, cols: int) -> torch.Tensor:
    """A matrix's raw GGUF bytes (rows of type `kind`, a gguf.GGMLQuantizationType, not one of
    blocks.GGUF_TYPES) -> uint8 blocks [rows, cols / 32 * bytes] in the format served() names."""
    if int(kind) == Q4_K:
        return _q4_k_as_q4_1(np.ascontiguousarray(data).reshape(-1, Q4_K_BYTES), rows)
    import gguf
    return blocks.quantize(torch.from_numpy(gguf.quants.dequantize(data, kind).reshape(rows, cols)), "q8_0")


def _q4_k_as_q4_1(b: np.ndarray, rows: int) -> torch.Tensor:
    """Q4_K blocks [n, 144] -> q4_1 blocks [rows, n * 8 / rows * 20]."""
    d, dmin = (b[:, i:i + 2].copy().view(np.float16).astype(np.float32) for i in (0, 2))  # [n, 1]
    s = b[:, 4:16].astype(np.uint8)
    # The 6-bit scale and minimum of each sub-block: the first four whole in bytes 0-3 and 4-7, the
    # last four from bytes 8-11's nibbles and the top two bits of bytes 0-7.
    sc = np.concatenate([s[:, 0:4] & 63, (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)], axis=1)
    mn = np.concatenate([s[:, 4:8] & 63, (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)], axis=1)
    scale = (d * sc.astype(np.float32)).astype(np.float16)  # [n, 8]
    minimum = (-(dmin * mn.astype(np.float32))).astype(np.float16)
    qs = b[:, 16:].reshape(-1, 4, 32)
    # Sub-block 2i is the low nibbles of the i-th 32 bytes, 2i + 1 their high nibbles.
    q = np.stack([qs & 0x0F, qs >> 4], axis=2).reshape(-1, 8, 32)
    packed = q[..., :16] | (q[..., 16:] << 4)  # q4_1: byte j holds weights j and j + 16
    out = np.concatenate([scale[..., None].view(np.uint8), minimum[..., None].view(np.uint8), packed], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(out).reshape(rows, -1))
