"""RMSNorm, and the gated RMSNorm of a linear-attention layer's output."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.ops import kernels


class RMSNorm(nn.Module):
    """weight * x / rms(x). A model whose checkpoint stores (1 + w) (Qwen3.5) is given 1 + w at load
    (engine/files/qwen3_5_layout.py): in f32 the product is the reference's."""

    def __init__(self, weight: torch.Tensor, eps: float, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", weight.to(dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.usable(x):
            return kernels.rms_norm(x, self.weight, self.eps)
        # Normalised in f32, rounded to x's dtype, then scaled: the reference's order of operations.
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


class GroupedRMSNorm(RMSNorm):
    """RMSNorm over each group of `size` values of x [..., groups * size], then scaled by weight
    [groups * size]: Qwen4-Exp's norm of its residual streams, each normed alone."""

    def __init__(self, weight: torch.Tensor, size: int, eps: float, dtype: torch.dtype):
        super().__init__(weight, eps, dtype)
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.usable(x):
            return kernels.rms_norm(x, self.weight, self.eps, self.size)
        groups = x.float().unflatten(-1, (-1, self.size))
        return self.weight * F.rms_norm(groups, (self.size,), eps=self.eps).flatten(-2).to(x.dtype)


GATE_ACTIVATIONS = {"silu": F.silu, "sigmoid": torch.sigmoid}


class GatedRMSNorm(nn.Module):
    """weight * x / rms(x) * act(gate), per head of a linear-attention layer's output, in f32 as
    transformers' Qwen3_5RMSNormGated computes it; act is SiLU (Qwen3.5) or the model's
    output_gate_type (Qwen4-Exp). x, gate: [..., head_dim]."""

    def __init__(self, weight: torch.Tensor, eps: float, activation: str = "silu"):
        super().__init__()
        self.register_buffer("weight", weight.float())
        self.eps = eps
        self.activation = GATE_ACTIVATIONS[activation]

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * normed.to(x.dtype) * self.activation(gate.float())).to(x.dtype)
