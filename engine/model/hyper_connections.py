"""Hyper-connections (Qwen4-Exp; docs/architecture.md, "Qwen4-Exp"): the residual is `hc_count`
streams of hidden_size, [N, hc * hidden], in place of one stream and its pre-norms.

Around a block (a layer's mixer, or its MLP): each stream is RMS-normed on its own (`hc_norm`); a
low-rank map gives per-value mixing weights m = sigmoid(up(silu(down(n) / hc))); the block reads the
mean over streams of m * n, [N, hidden]; its output is added to each stream s scaled by
2 * sigmoid(inject(n) / hc)_s. After the last layer a mixer of the same form, without injection,
gives the [N, hidden] states the lm_head reads.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engine.files.model_config import ModelConfig
from engine.model.norm import GroupedRMSNorm
from engine.ops import kernels
from engine.ops.quant import Linear, compute_dtype


class HyperConnection(nn.Module):
    def __init__(self, c: ModelConfig, t: dict, p: str, dtype: str, inject: bool = True):
        super().__init__()
        self.streams, self.hidden = c.hc_count, c.hidden_size
        self.hc_norm = GroupedRMSNorm(t[p + "hc_norm.weight"], c.hidden_size, c.rms_norm_eps, compute_dtype(dtype))
        self.down = Linear(t[p + "input_mix_weight_down.weight"], None, dtype)
        self.up = Linear(t[p + "input_mix_weight_up.weight"], None, dtype)
        self.inject = Linear(t[p + "block_inject_weight.weight"], None, dtype) if inject else None

    @functools.cached_property
    def _maps(self) -> list[Linear]:
        return [self.down, self.up] + ([self.inject] if self.inject is not None else [])

    @functools.cached_property
    def _kernel_weights(self) -> list[torch.Tensor | None]:
        """(weight, scale, bias) of down, up and inject, as hyper_mix and hyper_inject read them."""
        return [t for m in self._maps for t in (m.weight, m.scale, m.bias)]

    @functools.cached_property
    def _kernel_rows(self) -> int:
        return min(m.max_kernel_rows for m in self._maps)

    def _kernel(self, x: torch.Tensor) -> bool:
        """Whether x's rows take the kernels (hyper_mix, hyper_inject): a few rows, each map's
        product the kernel's."""
        return x.dim() == 2 and x.shape[0] <= self._kernel_rows and kernels.usable(x)

    def _q8(self) -> bool:
        return any(m.q8_activations for m in self._maps)

    def mix(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hc * hidden] -> (the block's input [N, hidden], the normed streams [N, hc * hidden])."""
        if self._kernel(x):  # the same ops in one call
            return kernels.hyper_mix(x, self.hc_norm.weight, self._kernel_weights[:6], self.streams, self.hc_norm.eps,
                                     self._q8())
        normed = self.hc_norm(x)
        weights = torch.sigmoid(self.up(F.silu(self.down(normed) / self.streams)))
        mixed = (weights.unflatten(-1, (self.streams, self.hidden)) * normed.unflatten(-1, (self.streams, self.hidden)))
        return mixed.mean(dim=-2), normed

    def forward(self, x: torch.Tensor, block: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """x [N, hc * hidden] with block's output on its mixed input added to every stream."""
        mixed, normed = self.mix(x)
        out = block(mixed)
        if self._kernel(x):
            return kernels.hyper_inject(x, normed, out, self._kernel_weights[6:], self.streams, self._q8())
        scale = 2 * torch.sigmoid(self.inject(normed) / self.streams)  # [N, hc]
        return x + (out.unsqueeze(-2) * scale.unsqueeze(-1)).flatten(-2)
