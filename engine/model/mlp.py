"""The gated SiLU MLP every family here shares: down(silu(gate(x)) * up(x)), gate and up fused."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.files.model_config import ModelConfig
from engine.model.fused import fused_linear
from engine.ops.quant import Linear


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, t: dict, p: str, dtype: str, inter: int | None = None):
        """p: the prefix of its gate_proj, up_proj and down_proj; inter: their width, when not the
        model's intermediate_size (an expert's)."""
        super().__init__()
        self.gate_up_proj = fused_linear(t, [p + "gate_proj", p + "up_proj"], c.mlp_bias, dtype)
        self.down_proj = Linear(t[p + "down_proj.weight"], t.get(p + "down_proj.bias") if c.mlp_bias else None, dtype)
        self.inter = inter or c.intermediate_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)
