"""Weight formats for linear layers: f32, bf16, and weight-only int8.

bf16 runs oneDNN's linear on a weight reordered once at load into its blocked layout (AMX or
AVX512-BF16 where the CPU has them): a plain bf16 matmul re-packs the weight on every call, which
at decode, one row at a time, makes it slower than f32.

int8 stores one scale per output channel and keeps activations in f32: quantizing activations
too loses far too much on small models (see DESIGN.md). Up to INT8_MATVEC_MAX_ROWS rows (decode
slots, verify tokens) torch's int8-weight kernel dequantizes as it reads, with its input rounded to
bf16 for the product only; beyond that (prefill, compute-bound anyway) the weight is dequantized
for an ordinary matmul.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DTYPES = ("f32", "bf16", "int8")
TORCH_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float32}
BYTES_PER_WEIGHT = {"f32": 4, "bf16": 2, "int8": 1}
# Up to this many rows the int8-weight kernel beats dequantizing the weight for a matmul.
INT8_MATVEC_MAX_ROWS = 16
PACKED_BF16 = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def compute_dtype(weight_dtype: str) -> torch.dtype:
    return TORCH_DTYPES[weight_dtype]


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: returns (int8 [out, in], f32 scale [out])."""
    w = w.float()
    scale = w.abs().amax(dim=1).clamp(min=1e-12) / 127.0
    q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q.contiguous(), scale


class Linear(nn.Module):
    """y = x W^T (+ b), with W in the chosen weight format. `keep_rows` keeps W readable by row
    (a tied embedding reads it) where the format would otherwise hold only a packed copy."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, dtype: str, keep_rows: bool = False):
        super().__init__()
        self.dtype = dtype
        self.packed = self.ones_bf16 = None
        if dtype == "int8":
            q, scale = quantize_int8(weight)
            self.register_buffer("weight", q)
            self.register_buffer("scale", scale)
            self.ones_bf16 = torch.ones_like(scale, dtype=torch.bfloat16)
        else:
            w = weight.to(TORCH_DTYPES[dtype]).contiguous()
            if dtype == "bf16" and PACKED_BF16:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
            self.register_buffer("weight", w if self.packed is None or keep_rows else None)
            self.scale = None
        self.register_buffer("bias", None if bias is None else bias.to(TORCH_DTYPES[dtype]))

    @property
    def out_features(self) -> int:
        return (self.weight if self.weight is not None else self.packed).shape[0]

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows of W (an embedding lookup when the lm_head is tied to the embedding)."""
        if self.scale is None:
            return self.weight[ids]
        return self.weight[ids].float() * self.scale[ids, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.scale is None:
            return F.linear(x, self.weight, self.bias)
        if x.shape[0] <= INT8_MATVEC_MAX_ROWS and x.dim() == 2:
            y = torch._weight_int8pack_mm(x.to(torch.bfloat16), self.weight, self.ones_bf16).to(x.dtype) * self.scale
        else:
            y = F.linear(x, self.weight.to(x.dtype)) * self.scale
        return y if self.bias is None else y + self.bias
