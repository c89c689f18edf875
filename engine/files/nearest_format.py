"""A GGUF file's block types that tandem's kernels do not read, in the nearest format they do,
converted once at load (under `--dtype auto`, and wherever a file's blocks are kept).

The kernels read Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K as stored
(engine/ops/blocks.py GGUF_TYPES). Every other type (Q2_K, Q3_K, the IQ types) is dequantized as
llama.cpp does and quantized to q8_0 by llama.cpp's reference rule: one step of max|w| / 127 per
block of 32, within half a step of the file's weights; the load log names each such tensor.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from engine.ops import blocks
from engine.ops.quant import FormatUse, tally


def served(kind: int | None, shape: tuple[int, ...]) -> str | None:
    """The block format a GGUF tensor of type `kind` and (HF) shape loads in where blocks are kept:
    its own, the nearest, or None (f32) for a plain type, a vector, or rows that are not whole blocks."""
    if kind is None or kind in blocks.GGUF_PLAIN_TYPES or len(shape) not in (2, 3) or shape[-1] % blocks.BLOCK:
        return None
    return blocks.GGUF_TYPES.get(kind, "q8_0")


def served_bytes(kind: int, shape: tuple[int, ...], stored: int) -> int:
    """The bytes such a tensor (`stored` in the file) takes once loaded as served() says."""
    fmt = served(kind, shape)
    return stored if fmt is None or kind in blocks.GGUF_TYPES else math.prod(shape) // blocks.BLOCK * blocks.BLOCK_BYTES[fmt]


def convert(data: np.ndarray, kind, rows: int, cols: int) -> torch.Tensor:
    """A matrix's raw GGUF bytes (rows of type `kind`, a gguf.GGMLQuantizationType, not one of
    blocks.GGUF_TYPES) -> uint8 q8_0 blocks [rows, cols / 32 * 34]."""
    import gguf
    return blocks.quantize(torch.from_numpy(gguf.quants.dequantize(data, kind).reshape(rows, cols)), "q8_0")


def stored_formats(files) -> dict[str, FormatUse]:
    """A ModelFiles' tensors per format under --dtype auto, from the headers: a GGUF file's quantized
    matrices in the block format they load in (served, above; an untied embedding aside: it is read
    in f32), the rest f32. (Not annotated: engine/files/weights.py reads its files through this
    module, which does not import it back.)"""
    untied_embedding = None if files.config.tie_word_embeddings else "model.embed_tokens.weight"

    def entries():
        for name, shape in (files.expected_shapes() if files.has_trunk else files.mtp_shapes()).items():
            kind, nbytes = files.stored.get(name, (None, 0))
            fmt = served(kind, shape) if len(shape) == 2 and name != untied_embedding else None
            yield (fmt, 1, served_bytes(kind, shape, nbytes)) if fmt else ("f32", 1, 4 * math.prod(shape))
    return tally(entries())
