"""Rotary position embedding tables: the default rule and the linear, llama3 and yarn scalings."""
from __future__ import annotations

import math

import torch

from engine.files.model_config import RopeConfig
from engine.ops import kernels


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> tuple[torch.Tensor, float]:
    """Returns ([head_dim / 2] inverse frequencies, attention factor applied to cos and sin)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    inv = 1.0 / (rope.theta ** exponents)
    if rope.freq_factors:
        inv = inv / torch.tensor(rope.freq_factors, dtype=torch.float32)
    if rope.kind == "linear":
        return inv / rope.factor, 1.0
    if rope.kind == "llama3":
        return _llama3(inv, rope), 1.0
    if rope.kind == "yarn":
        return _yarn(inv, rope, head_dim)
    return inv, 1.0


def _llama3(inv: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are divided by the factor, short ones kept, the band between blended.
    low_wavelen = rope.original_max_positions / rope.low_freq_factor
    high_wavelen = rope.original_max_positions / rope.high_freq_factor
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / rope.factor, inv)
    smooth = (rope.original_max_positions / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def _yarn(inv: torch.Tensor, rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    factor = rope.factor
    if rope.attention_factor is not None:
        attention = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
    else:
        attention = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(rope.original_max_positions / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    return (inv / factor) * (1 - extrapolation) + inv * extrapolation, attention


def rope_table(rope: RopeConfig, head_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin for every position, each [max_positions, head_dim] (both halves repeated);
    head_dim: the dims RoPE turns (ModelConfig.rotary_dim)."""
    inv, attention = inverse_frequencies(rope, head_dim)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * attention, angles.sin() * attention


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """apply_rope; in place, by tandem's kernel, where it is usable (inference)."""
    if not kernels.usable(x):
        return apply_rope(x, cos, sin)
    kernels.rope_(x, cos, sin)
    return x


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [N, heads, head_dim]; cos, sin: [N, 1, R], R the rotary dims (head_dim, or fewer for partial
    RoPE: then only each head's first R dims turn). Rotates the two halves of those dims."""
    r = cos.shape[-1]
    turned, kept = x[..., :r], x[..., r:]
    half = r // 2
    rotated = torch.cat([-turned[..., half:], turned[..., :half]], dim=-1)
    out = turned * cos + rotated * sin
    return out if r == x.shape[-1] else torch.cat([out, kept], dim=-1)
