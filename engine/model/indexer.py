"""QSA as Qwen4-Exp defines it (docs/architecture.md, "QSA: the model's indexer"), as transformers'
Qwen4ExpTextQSAIndexer computes it.

An indexed attention layer with compress ratio r groups positions into blocks of r. Its indexer
projects each token to `heads` query heads and one raw key of `head_dim`. Queries are RMS-normed
(q_layernorm) and turned by RoPE at their position. A block's key is the mean of its positions' raw
keys, RMS-normed (k_layernorm) and turned by RoPE at the block's first position; tandem computes it
once, when the block's last position is written, and keeps it in the cache (the reference pools
again on every forward).

Selection then follows QSA's one rule (engine/model/qsa.py) over these block keys.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.files.model_config import ModelConfig
from engine.model.norm import RMSNorm
from engine.model.rope import apply_rope
from engine.ops import blocks
from engine.ops.quant import Linear, compute_dtype


class Indexer(nn.Module):
    def __init__(self, c: ModelConfig, t: dict, p: str, dtype: str, cos: torch.Tensor, sin: torch.Tensor):
        """p: the layer's `self_attn.indexer.` prefix; cos, sin: the model's RoPE tables
        [positions, rotary dims], read at the blocks' first positions."""
        super().__init__()
        x = c.indexer
        self.heads, self.head_dim, self.ratio, self.keep = x.heads, x.head_dim, x.ratio, x.budget // x.ratio
        # One projection for q and k (a GGUF file holds it as two).
        qk = t.get(p + "index_qk_proj.weight")
        self.proj = Linear(qk if qk is not None else blocks.cat_rows([t[p + "q_proj.weight"], t[p + "k_proj.weight"]]),
                           None, dtype)
        cdt = compute_dtype(dtype)
        self.q_norm = RMSNorm(t[p + "q_layernorm.weight"], c.rms_norm_eps, cdt)
        self.k_norm = RMSNorm(t[p + "k_layernorm.weight"], c.rms_norm_eps, cdt)
        self.cos, self.sin = cos, sin  # the model's, shared: not this module's buffers

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, hidden] -> (queries [N, heads, head_dim] normed and turned, raw keys [N, head_dim]).
        cos, sin: the rows' [N, 1, R]."""
        q, k = self.proj(x).split([self.heads * self.head_dim, self.head_dim], dim=-1)
        q = self.q_norm(q.reshape(-1, self.heads, self.head_dim))
        return apply_rope(q, cos.to(q.dtype), sin.to(q.dtype)), k

    def pool(self, raw: torch.Tensor, first: int) -> torch.Tensor:
        """The keys of whole blocks first, first+1, ... from their raw keys [blocks * r, head_dim]:
        [blocks, head_dim], meaned in f32, normed, turned at each block's first position."""
        pooled = self.k_norm(raw.float().unflatten(0, (-1, self.ratio)).mean(1).to(raw.dtype))
        starts = (first + torch.arange(pooled.shape[0])) * self.ratio
        cos, sin = self.cos[starts, None].to(pooled.dtype), self.sin[starts, None].to(pooled.dtype)
        return apply_rope(pooled[:, None], cos, sin)[:, 0]
