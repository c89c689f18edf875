"""Weight formats for linear layers: f32, bf16, and weight-only int8.

int8 stores one scale per output channel and keeps activations in f32: quantizing activations
too loses far too much on small models (see DESIGN.md). Decode is a matrix-vector product that
dequantizes as it reads, compiled once per weight shape; prefill dequantizes the weight and uses
an ordinary matmul, since it is compute-bound anyway.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = ("f32", "bf16", "int8")
TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float32}
BYTES_PER_WEIGHT = {"f32": 4, "bf16": 2, "int8": 1}
# Up to this many rows (decode slots, verify tokens) the dequantizing product beats a dequantized matmul.
INT8_MATVEC_MAX_ROWS = 16


def compute_dtype(weight_dtype: str) -> torch.dtype:
    return TORCH_DTYPES[weight_dtype]


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: returns (int8 [out, in], f32 scale [out])."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


def _int8_matvec(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    # x: [rows, in] f32, q: [out, in] int8. Written as a broadcast product and a sum so that the
    # compiler fuses the int8->f32 conversion into the reduction and never materialises the weight.
    return (x[:, None, :] * q[None, :, :].to(x.dtype)).sum(-1) * scale


_compiled_matvec = None


def int8_matvec(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    global _compiled_matvec
    if _compiled_matvec is None:
        _compiled_matvec = torch.compile(_int8_matvec, dynamic=False, fullgraph=True)
    return _compiled_matvec(x, q, scale)


class Linear(nn.Module):
    """y = x W^T (+ b), with W in the chosen weight format."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: str):
        super().__init__()
        self.dtype = dtype
        if dtype == "int8":
            q, scale = quantize_int8(weight)
            self.register_buffer("weight", q)
            self.register_buffer("scale", scale)
        else:
            self.register_buffer("weight", weight.to(TORCH_DTYPES[dtype]).contiguous())
            self.scale = None
        self.register_buffer("bias", None if bias is None else bias.to(TORCH_DTYPES[dtype]))

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def dequantized(self) -> torch.Tensor:
        """The weight as a floating-point matrix [out, in] (a copy for int8)."""
        if self.scale is None:
            return self.weight
        return self.weight.float() * self.scale[:, None]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of W (an embedding lookup when the lm_head is tied to the embedding)."""
        if self.scale is None:
            return self.weight[ids]
        return self.weight[ids].float() * self.scale[ids, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] <= INT8_MATVEC_MAX_ROWS and x.dim() == 2:
            y = int8_matvec(x, self.weight, self.scale)
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scale
        return y if self.bias is None else y + self.bias
