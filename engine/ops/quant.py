"""Weight formats for linear layers: f32, bf16, weight-only int8, and GGUF's blocks (q4_0, q4_1,
q5_0, q8_0, and as files hold them q5_1 and the K-quants q4_k, q5_k, q6_k: engine/ops/blocks.py).

int8 stores one scale per output channel and keeps activations in floating point: quantizing
activations too loses far too much on small models (docs/architecture.md, "Weight formats"). A
block weight multiplies f32 activations, widened to the very number the f32 path reads (the
product is the f32 path's up to summation order), or, with 8-bit activations (use_activations;
--activations), activations quantized per block of 32 in integer dot products, as llama.cpp does.

A step of a few rows (decode slots, verify tokens) is a matrix-vector product whose speed is how
fast the weights stream from memory; tandem's own kernel (engine/ops/csrc/linear.cpp) widens each
format to f32 as it reads. Beyond KERNEL_MAX_ROWS rows (prefill) the work is compute-bound and
torch's matmul takes over (int8 and blocks through a dequantized copy of the weight, per call).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.ops import blocks, kernels
from engine.ops.blocks import STACKED, BlockTensor, StackedBlocks
from engine.settings import BLOCK_DTYPES

log = logging.getLogger("tandem.quant")

# Bytes per weight of each format a tensor can be stored in ("auto" is a choice among them).
BYTES_PER_WEIGHT = {"f32": 4, "bf16": 2, "int8": 1, **{f: blocks.bytes_per_weight(f) for f in blocks.SERVED}}
# Up to this many rows tandem's kernel beats torch's matmul (measured on the default model's layers).
KERNEL_MAX_ROWS = {"f32": 32, "bf16": 8, "int8": 64, **{f: 32 for f in (*blocks.SERVED, STACKED)}}
FORMAT_NAMES = {torch.float32: "f32", torch.bfloat16: "bf16"}


def compute_dtype(weight_dtype: str) -> torch.dtype:
    """The type a layer stored as `weight_dtype` computes in: bf16's bf16, every other's (int8, the
    block formats, those read as files hold them too) f32."""
    return torch.bfloat16 if weight_dtype == "bf16" else torch.float32


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: returns (int8 [out, in], f32 scale [out])."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


def stored_format(weight: torch.Tensor | BlockTensor | StackedBlocks, dtype: str) -> str:
    """The format a linear weight is kept in under `dtype`. "auto" keeps a block weight's format (a
    stacked one's parts theirs) and f32 otherwise; a block format applies to a weight whose rows are
    whole blocks, and f32 holds the others (in-features not a multiple of 32)."""
    if dtype == "auto":
        return weight.format if isinstance(weight, (BlockTensor, StackedBlocks)) else "f32"
    if dtype in blocks.FORMATS and not blocks.fits(tuple(weight.shape)):
        return "f32"
    return dtype


def keeps_blocks(dtype: str) -> bool:
    """Whether a model loads its GGUF blocks as they are under `dtype` (the formats that serve them)."""
    return dtype in BLOCK_DTYPES


class Linear(nn.Module):
    """y = x W^T (+ b), with W in the format `dtype` gives it (stored_format). weight: f32, or a
    block weight as the file holds it (kept as it is when the format is its own; a stacked one's parts
    each in theirs, its layout in the scale's place). parts: how many of the file's tensors the layer
    holds (a fused projection holds several)."""

    def __init__(self, weight: torch.Tensor | BlockTensor | StackedBlocks, bias: torch.Tensor | None, dtype: str,
                 parts: int = 1):
        super().__init__()
        fmt = stored_format(weight, dtype)
        if fmt != dtype and dtype != "auto":
            log.info("weight %s: in-features not a multiple of %d, kept f32 instead of %s",
                     list(weight.shape), blocks.BLOCK, dtype)
        self.dtype, self.parts, self.cols = fmt, parts, weight.shape[1]
        self.max_kernel_rows = KERNEL_MAX_ROWS[fmt]
        self.register_buffer("scale", None)
        if fmt == STACKED:
            self.register_buffer("weight", weight.bytes())
            self.register_buffer("scale", weight.layout())
        elif fmt in blocks.SERVED:
            own = isinstance(weight, BlockTensor) and weight.format == fmt
            data = weight.data if own else blocks.quantize(blocks.to_f32(weight), fmt)
            self.register_buffer("weight", blocks.kernel_view(data.contiguous(), fmt, self.cols))
        elif fmt == "int8":
            q, scale = quantize_int8(blocks.to_f32(weight))
            self.register_buffer("weight", q)
            self.register_buffer("scale", scale)
        else:
            self.register_buffer("weight", blocks.to_f32(weight).to(compute_dtype(fmt)).contiguous())
        self.register_buffer("bias", None if bias is None else bias.to(compute_dtype(fmt)))
        self.q8_activations = False  # use_activations() sets it on block weights

    @property
    def is_blocks(self) -> bool:
        return self.dtype in blocks.SERVED or self.dtype == STACKED

    def stacked_parts(self) -> list[BlockTensor]:
        return blocks.unstack(self.weight, self.scale, self.cols)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of W (an embedding lookup when the lm_head is tied to the embedding)."""
        if self.is_blocks:
            return self._dequantized(self.weight[ids].reshape(-1, *self.weight.shape[1:])).view(*ids.shape, self.cols)
        if self.scale is None:
            return self.weight[ids]
        return self.weight[ids].float() * self.scale[ids, None]

    def _dequantized(self, rows: torch.Tensor) -> torch.Tensor:
        """Block rows (as the weight holds them) -> f32 [n, cols]: the kernel on the CPU, torch's ops on other
        devices (the kernels are CPU-only); the same numbers either way."""
        layout = self.scale if self.dtype == STACKED else None
        if kernels.usable(rows):
            return kernels.dequantize_blocks(rows, self.cols, layout)
        if layout is not None:
            return torch.cat([p.dequantize() for p in blocks.unstack(rows, layout, self.cols)])
        return blocks.dequantize(rows, self.dtype, self.cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # With 8-bit activations every row count takes the kernel: a prompt chunk's rows are then
        # the numbers its decode rows would be, as a verify row is its decode row's.
        if x.dim() == 2 and (self.q8_activations or x.shape[0] <= self.max_kernel_rows) and kernels.usable(x):
            return kernels.linear_rows(x, self.weight, self.scale, self.bias, self.q8_activations)
        if self.is_blocks:
            return F.linear(x, self._dequantized(self.weight), self.bias)
        if self.scale is None:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight.to(x.dtype)) * self.scale
        return y if self.bias is None else y + self.bias


def resolve_activations(choice: str, dtype: str, formats: Iterable[str] = ()) -> str:
    """What --activations (checked by EngineConfig) means for a model loaded under `dtype` whose file
    holds `formats` (engine.files.nearest_format.stored_formats): "auto" is q8 where the weights are
    blocks and the kernels' 8-bit path reaches every format, f32 elsewhere. On AVX2 the K-quants keep
    f32 activations (kernels.q8_activations_cover), so a file with them stays f32 as a whole: its
    32-weight blocks alone under q8 gave greedy tokens neither the f32 path's nor llama-server's."""
    if choice == "auto":
        covered = all(kernels.q8_activations_cover(f) for f in formats)
        return "q8" if keeps_blocks(dtype) and kernels.q8_activations_supported() and covered else "f32"
    if choice == "q8" and not kernels.q8_activations_supported():  # the CPU has them, the build does not
        log.warning("--activations q8: tandem's kernels are not built with their 8-bit path here; f32 instead")
        return "f32"
    return choice


def use_activations(model: nn.Module, activations: str) -> int:
    """Sets every block-weight Linear of `model` to multiply f32 or 8-bit activations ("f32" or "q8",
    resolved); returns how many layers take q8."""
    layers = [m for m in model.modules() if isinstance(m, Linear) and m.is_blocks]
    for m in layers:
        m.q8_activations = activations == "q8"
    return len(layers) if activations == "q8" else 0


@dataclass
class FormatUse:
    """How many of a model's tensors one format holds, and their bytes."""
    tensors: int = 0
    nbytes: int = 0


def tally(entries) -> dict[str, FormatUse]:
    """(format, tensors, bytes) entries summed per format, most bytes first."""
    use: dict[str, FormatUse] = {}
    for fmt, tensors, nbytes in entries:
        u = use.setdefault(fmt, FormatUse())
        u.tensors, u.nbytes = u.tensors + tensors, u.nbytes + nbytes
    return dict(sorted(use.items(), key=lambda kv: -kv[1].nbytes))


def weight_formats(model: nn.Module, plain: tuple[torch.Tensor, ...] = ()) -> dict[str, FormatUse]:
    """Per format, the model's tensors (each linear layer counting the file tensors it holds; its
    bias in its compute type), norms and `plain` tensors (an untied embedding)."""
    def entries():
        for m in model.modules():
            if isinstance(m, Linear):
                if m.dtype == STACKED:  # each run of one format counts once
                    yield from ((p.format, 1, p.data.nbytes) for p in m.stacked_parts())
                else:
                    yield m.dtype, m.parts, m.weight.nbytes + (0 if m.scale is None else m.scale.nbytes)
                if m.bias is not None:
                    yield FORMAT_NAMES[m.bias.dtype], m.parts, m.bias.nbytes
            elif m._buffers.get("weight") is not None:  # a norm
                yield FORMAT_NAMES[m.weight.dtype], 1, m.weight.nbytes
        for t in plain:
            yield FORMAT_NAMES[t.dtype], 1, t.nbytes
    return tally(entries())


def describe_formats(use: dict[str, FormatUse]) -> str:
    return ", ".join(f"{fmt} {u.nbytes / 2**20:.1f} MiB ({u.tensors} tensors)" for fmt, u in use.items())
