"""Block weights of every format tandem's kernels read, for tests: the formats tandem quantizes to
by its own quantizer, q5_1 by the gguf package's, and the types no Python quantizer writes (the
K-quants, IQ types) as random bytes with small positive f16 scales: any bytes are valid blocks."""
from __future__ import annotations

import gguf
import numpy as np
import torch

from engine.ops import blocks

Q = gguf.GGMLQuantizationType
GGUF_KIND = {fmt: Q(kind) for kind, fmt in blocks.GGUF_TYPES.items()}
READ_ONLY = tuple(f for f in blocks.SERVED if f not in blocks.FORMATS)  # read as files hold them
# Where each random-byte type's f16 scales lie in its block (d, and dmin where it has one).
F16_AT = {Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208], Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.IQ4_NL: [0],
          Q.IQ4_XS: [0]}


def random_blocks(kind: Q, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, bytes]: random blocks of `kind` with small positive f16 scales."""
    per, size = gguf.GGML_QUANT_SIZES[kind]
    rng = np.random.default_rng(seed * 1000 + int(kind))
    data = rng.integers(0, 256, (rows * cols // per, size), dtype=np.uint8)
    for offset in F16_AT[kind]:
        data[:, offset:offset + 2] = rng.uniform(0.001, 0.05, (len(data), 1)).astype(np.float16).view(np.uint8)
    return data.reshape(rows, -1)


def sample_blocks(fmt: str, rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """uint8 [rows, bytes] of a weight in `fmt`, as a file stores it."""
    if fmt in blocks.FORMATS:
        return blocks.quantize(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)), fmt)
    if fmt == "q5_1":
        rng = np.random.default_rng(seed)
        return torch.from_numpy(gguf.quants.quantize(rng.standard_normal((rows, cols), dtype=np.float32), Q.Q5_1))
    return torch.from_numpy(random_blocks(GGUF_KIND[fmt], rows, cols, seed))


def widths(fmt: str) -> list[int]:
    """Row widths a format holds, as the families use them: a K-quant's rows are whole super-blocks
    (a 576-wide row falls back to Q5_0 or Q5_1 in llama-quantize)."""
    return [256, 1024, 2048, 4096] if fmt in blocks.SUPER_BYTES else [96, 576, 1024, 2080]
