"""Projections that read the same input, fused into one matrix at load, and back into their
checkpoint names (for draft training, train/)."""
from __future__ import annotations

import torch

from engine.files.model_config import ModelConfig
from engine.ops import blocks
from engine.ops.quant import Linear

# Each fused projection's checkpoint names, in order.
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fused_linear(t: dict, parts: list[str], with_bias: bool, dtype: str) -> Linear:
    """One Linear of the checkpoint's projections `parts` (full names, without `.weight`)."""
    weight = blocks.cat_rows([t[n + ".weight"] for n in parts])  # blocks run along the input: rows stack
    bias = torch.cat([t[n + ".bias"] for n in parts]) if with_bias else None
    return Linear(weight, bias, dtype, parts=len(parts))


def split_fused(tensors: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """Module tensors -> checkpoint names: each fused projection back into its parts."""
    sizes = {"self_attn.qkv_proj": [config.q_size, config.kv_size, config.kv_size],
             "mlp.gate_up_proj": [config.intermediate_size] * 2}
    out = {}
    for name, value in tensors.items():
        fused = next((f for f in FUSED if f + "." in name), None)
        if fused is None:
            out[name] = value
            continue
        for part, piece in zip(FUSED[fused], value.split(sizes[fused])):
            out[name.replace(fused, part)] = piece
    return out
