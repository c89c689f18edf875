"""The decoder-only transformer shared by the Llama, Mistral, Qwen2 and Qwen3 families.

Tokens of all rows of a step run through the linear layers together as one [N, hidden] matrix;
attention runs per row, over views of that row's slot in the KV cache.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.batch import ForwardBatch
from engine.config import ModelConfig
from engine.kv_cache import KVCache
from engine.quant import Linear, compute_dtype
from engine.rope import apply_rope, rope_table


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", weight.to(dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, t: dict, p: str, dtype: str):
        super().__init__()
        bias = (lambda n: t.get(p + n)) if c.attention_bias else (lambda n: None)
        self.q_proj = Linear(t[p + "q_proj.weight"], bias("q_proj.bias"), dtype)
        self.k_proj = Linear(t[p + "k_proj.weight"], bias("k_proj.bias"), dtype)
        self.v_proj = Linear(t[p + "v_proj.weight"], bias("v_proj.bias"), dtype)
        self.o_proj = Linear(t[p + "o_proj.weight"], None, dtype)
        cdt = compute_dtype(dtype)
        self.q_norm = RMSNorm(t[p + "q_norm.weight"], c.rms_norm_eps, cdt) if c.qk_norm else None
        self.k_norm = RMSNorm(t[p + "k_norm.weight"], c.rms_norm_eps, cdt) if c.qk_norm else None
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.group = c.num_heads // c.num_kv_heads

    def forward(self, x, batch: ForwardBatch, cos, sin, cache: KVCache, layer: int) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.heads, self.head_dim)
        k = self.k_proj(x).view(n, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        cache_dtype = cache.k[layer].dtype
        out = torch.empty_like(q)
        offset = 0
        for row, mask in zip(batch.rows, batch.masks):
            t = len(row.tokens)
            sl = slice(offset, offset + t)
            cache.write(layer, row.slot, row.start, k[sl].transpose(0, 1).to(cache_dtype),
                        v[sl].transpose(0, 1).to(cache_dtype))
            keys, values = cache.read(layer, row.slot, row.start + t)
            out[sl] = self._attend(q[sl], keys.to(q.dtype), values.to(q.dtype), mask)
            offset += t
        return self.o_proj(out.view(n, self.heads * self.head_dim))

    def _attend(self, q, keys, values, mask) -> torch.Tensor:
        # Grouped-query attention without repeating K/V: the `group` query heads that share a kv
        # head are stacked along the query axis. q: [T, heads, d] -> [kv_heads, group*T, d].
        t = q.shape[0]
        qg = q.view(t, self.kv_heads, self.group, self.head_dim).permute(1, 2, 0, 3)
        qg = qg.reshape(self.kv_heads, self.group * t, self.head_dim)
        if mask is not None:
            mask = mask.repeat(self.group, 1)
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=mask)
        # [kv_heads, group*T, d] -> [T, heads, d]
        return o.view(self.kv_heads, self.group, t, self.head_dim).permute(2, 0, 1, 3).reshape(t, self.heads, self.head_dim)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, t: dict, p: str, dtype: str):
        super().__init__()
        bias = (lambda n: t.get(p + n)) if c.mlp_bias else (lambda n: None)
        self.gate_proj = Linear(t[p + "gate_proj.weight"], bias("gate_proj.bias"), dtype)
        self.up_proj = Linear(t[p + "up_proj.weight"], bias("up_proj.bias"), dtype)
        self.down_proj = Linear(t[p + "down_proj.weight"], bias("down_proj.bias"), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, t: dict, index: int, dtype: str):
        super().__init__()
        p = f"model.layers.{index}."
        cdt = compute_dtype(dtype)
        self.index = index
        self.input_layernorm = RMSNorm(t[p + "input_layernorm.weight"], c.rms_norm_eps, cdt)
        self.self_attn = Attention(c, t, p + "self_attn.", dtype)
        self.post_attention_layernorm = RMSNorm(t[p + "post_attention_layernorm.weight"], c.rms_norm_eps, cdt)
        self.mlp = MLP(c, t, p + "mlp.", dtype)

    def forward(self, x, batch, cos, sin, cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, cos, sin, cache, self.index)
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """Built from f32 tensors under HF names; `dtype` is the weight format (f32, bf16, int8)."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: str = "f32",
                 max_positions: int | None = None):
        super().__init__()
        self.config, self.dtype = config, dtype
        self.compute_dtype = compute_dtype(dtype)
        head = tensors["model.embed_tokens.weight"] if config.tie_word_embeddings else tensors["lm_head.weight"]
        self.lm_head = Linear(head, None, dtype)
        # A tied embedding is read from the lm_head's (possibly quantized) rows: one copy in memory.
        self.embed = None if config.tie_word_embeddings else \
            tensors["model.embed_tokens.weight"].to(self.compute_dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, tensors, i, dtype) for i in range(config.num_layers))
        self.norm = RMSNorm(tensors["model.norm.weight"], config.rms_norm_eps, self.compute_dtype)
        cos, sin = rope_table(config.rope, config.head_dim, max_positions or config.max_position_embeddings)
        self.register_buffer("cos", cos.to(self.compute_dtype))
        self.register_buffer("sin", sin.to(self.compute_dtype))

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            return self.embed[ids]
        return self.lm_head.rows(ids).to(self.compute_dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Runs the batch, writing its K/V into the cache. Returns hidden states after the final
        norm, [N, hidden]: the vectors that feed the lm_head (and the MTP draft)."""
        x = self.embed_tokens(batch.token_ids)
        cos = self.cos[batch.positions].unsqueeze(1)  # [N, 1, head_dim]
        sin = self.sin[batch.positions].unsqueeze(1)
        for layer in self.layers:
            x = layer(x, batch, cos, sin, cache)
        return self.norm(x)

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] -> [rows, vocab] f32."""
        return self.lm_head(hidden).float()
