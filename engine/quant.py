"""Weight formats for linear layers: f32, bf16, and weight-only int8.

int8 stores one scale per output channel and keeps activations in floating point: quantizing
activations too loses far too much on small models (docs/architecture.md, "Weight formats").

A step of a few rows (decode slots, verify tokens) is a matrix-vector product whose speed is how
fast the weights stream from memory; tandem's own kernel (engine/csrc/linear.cpp) widens each
format to f32 as it reads. Beyond KERNEL_MAX_ROWS rows (prefill) the work is compute-bound and
torch's matmul takes over (int8 through a dequantized copy of the weight).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine import kernels
from engine.options import DTYPES

TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float32}
BYTES_PER_WEIGHT = {"f32": 4, "bf16": 2, "int8": 1}
# Up to this many rows tandem's kernel beats torch's matmul (measured on the default model's layers).
KERNEL_MAX_ROWS = {"f32": 32, "bf16": 8, "int8": 64}


def compute_dtype(weight_dtype: str) -> torch.dtype:
    return TORCH_DTYPES[weight_dtype]


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: returns (int8 [out, in], f32 scale [out])."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


class Linear(nn.Module):
    """y = x W^T (+ b), with W in the chosen weight format."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: str):
        super().__init__()
        self.dtype = dtype
        self.max_kernel_rows = KERNEL_MAX_ROWS[dtype]
        if dtype == "int8":
            q, scale = quantize_int8(weight)
            self.register_buffer("weight", q)
            self.register_buffer("scale", scale)
        else:
            self.register_buffer("weight", weight.to(TORCH_DTYPES[dtype]).contiguous())
            self.scale = None
        self.register_buffer("bias", None if bias is None else bias.to(TORCH_DTYPES[dtype]))

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of W (an embedding lookup when the lm_head is tied to the embedding)."""
        if self.scale is None:
            return self.weight[ids]
        return self.weight[ids].float() * self.scale[ids, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= self.max_kernel_rows and kernels.usable(x):
            return kernels.linear_rows(x, self.weight, self.scale, self.bias)
        if self.scale is None:
            return F.linear(x, self.weight, self.bias)
        y = F.linear(x, self.weight.to(x.dtype)) * self.scale
        return y if self.bias is None else y + self.bias
