"""Softmax attention over a layer's KV cache: dense, or QSA over key blocks (engine/model/qsa.py), as
the layer's LayerSpec says; with Qwen3.5's output gate where the model has
one (each head's query comes with a gate, and the head's output is scaled by sigmoid(gate)).

Rows of one token of a dense layer attend in one kernel call; the others (prompt chunks, verify
rows, QSA layers) attend row by row over views of their slot's cache.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.files.model_config import ModelConfig
from engine.model import qsa
from engine.model.batch import ForwardBatch
from engine.model.fused import fused_linear
from engine.model.indexer import Indexer
from engine.model.kv_cache import KVCache
from engine.model.norm import RMSNorm
from engine.model.layer_spec import LayerSpec
from engine.model.rope import rotate
from engine.ops import blocks, kernels
from engine.ops.quant import Linear, compute_dtype


def gated_qkv(t: dict, p: str, c: ModelConfig, dtype: str) -> Linear:
    """A gated layer's q_proj holds, per head, its query rows then its gate rows; fused here as
    [q of every head; k; v; gate of every head], so that q and k sit side by side as the ungated
    layer's do."""
    q_and_gate = t[p + "q_proj.weight"]
    rows = torch.arange(2 * c.q_size).view(c.num_heads, 2, c.head_dim)
    q, gate = (blocks.take_rows(q_and_gate, rows[:, i].flatten()) for i in (0, 1))
    return Linear(blocks.cat_rows([q, t[p + "k_proj.weight"], t[p + "v_proj.weight"], gate]), None, dtype, parts=3)


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, t: dict, p: str, dtype: str, spec: LayerSpec,
                 rope: tuple[torch.Tensor, torch.Tensor] | None = None):
        """rope: the model's cos and sin tables, which a layer with its model's QSA indexer reads."""
        super().__init__()
        self.spec = spec
        self.indexer = Indexer(c, t, p + "indexer.", dtype, *rope) if spec.index_dim else None
        self.gated = c.attn_output_gate
        self.qkv_proj = gated_qkv(t, p, c, dtype) if self.gated else \
            fused_linear(t, [p + "q_proj", p + "k_proj", p + "v_proj"], c.attention_bias, dtype)
        self.o_proj = Linear(t[p + "o_proj.weight"], None, dtype)
        cdt = compute_dtype(dtype)
        self.q_norm = RMSNorm(t[p + "q_norm.weight"], c.rms_norm_eps, cdt) if c.qk_norm else None
        self.k_norm = RMSNorm(t[p + "k_norm.weight"], c.rms_norm_eps, cdt) if c.qk_norm else None
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.group = c.num_heads // c.num_kv_heads

    def forward(self, x, batch: ForwardBatch, cos, sin, cache: KVCache, layer: int) -> torch.Tensor:
        n, heads = x.shape[0], self.heads
        qkv = self.qkv_proj(x).view(n, -1, self.head_dim)  # q, k, v heads (and the gates)
        qk = qkv[:, :heads + self.kv_heads]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])], dim=1)
        qk = rotate(qk, cos, sin)  # q and k in one pass
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + self.kv_heads:heads + 2 * self.kv_heads]
        out = torch.empty_like(q)
        # Rows of one token go through one kernel call when the cache holds floats of q's dtype or
        # q8_0, in a QSA layer while each still sees every position (its complete blocks within the
        # budget: dense attention, exactly); the others (prompt chunks, verify rows, QSA rows past
        # the budget) attend row by row.
        store = cache.kernel_view(layer, q.dtype) if kernels.usable(q) and len(batch.decode_index) \
            and (not self.spec.is_qsa or self._dense(batch.decode_positions)) else None
        if store is not None:
            i, slots, positions = batch.decode_index, batch.decode_slots, batch.decode_positions
            if len(i) == n:  # every row decodes: views, not gathers
                i = slice(None)
            cache.write_tokens(layer, slots, positions, k[i], v[i])
            out[i] = kernels.decode_attention(q[i], store.k, store.v, slots, positions + 1, self.head_dim ** -0.5,
                                              pages=store.pages, k_scale=store.k_scale, v_scale=store.v_scale)
        cache_dtype = cache.k[layer].dtype
        if self.indexer is not None:
            index_q, index_k = self.indexer.project(x, cos, sin)
        selections = [None] * len(batch.rows)  # per row, the keys its queries attend (None: all before them)
        offset = 0
        for i, (row, mask) in enumerate(zip(batch.rows, batch.masks)):
            t = len(row.tokens)
            sl = slice(offset, offset + t)
            offset += t
            if t == 1 and store is not None:
                if self.indexer is not None:  # its keys for the blocks later rows select from
                    self._write_index_keys(index_k[sl], row, cache, layer)
                continue
            cache.write(layer, row.slot, row.start, k[sl].transpose(0, 1).to(cache_dtype),
                        v[sl].transpose(0, 1).to(cache_dtype))
            if self.indexer is not None:
                self._write_index_keys(index_k[sl], row, cache, layer)
            scores = self._block_scores(index_q[sl] if self.indexer is not None else q[sl], batch.rope[sl],
                                        batch.positions[sl], row, cache, layer) if self.spec.is_qsa else None
            # A lone query (a decode row) takes its keys' positions straight from its scores.
            lone = scores is not None and t == 1 and mask is None and batch.probes is None
            selected = None if scores is None or lone else \
                qsa.allowed(scores, batch.rope[sl], row.start + t, self.spec.ratio, self.spec.keep,
                            None if self.indexer is not None else mask)
            selections[i] = selected
            if scores is None:
                keys, values = cache.read(layer, row.slot, row.start + t)
            elif t == 1:
                positions = qsa.attended(scores, row.start, self.spec.ratio, self.spec.keep) if lone else \
                    selected[0].nonzero()[:, 0]
                at = cache.rows_at(layer, row.slot, positions, q.dtype) if kernels.usable(q) \
                    and q.dtype == torch.float32 else None
                if at is not None:  # read where they lie, not gathered first
                    out[sl] = kernels.attend_at(q[sl][0], *at, self.head_dim ** -0.5)[None]
                    continue
                (keys, values), mask = cache.read_at(layer, row.slot, positions), None
            else:
                index = selected.any(0).nonzero()[:, 0]  # the union of the queries' selections
                (keys, values), mask = cache.read_at(layer, row.slot, index), selected[:, index]
            # A chain's prompt chunk sees every key before it: only its own block is causal.
            prefix = row.start if scores is None and row.depths is None else 0
            out[sl] = self._attend(q[sl], keys.to(q.dtype), values.to(q.dtype), mask, prefix)
        if batch.probes is not None:
            self._probe(q, k, batch, cache, layer, selections)
        if self.gated:
            out = out * torch.sigmoid(qkv[:, heads + 2 * self.kv_heads:])
        return self.o_proj(out.view(n, heads * self.head_dim))

    def _dense(self, positions: torch.Tensor) -> bool:
        """Whether queries at `positions` of this QSA layer all see no more complete blocks than it
        keeps (so attend to every position before them)."""
        return int(qsa.complete_blocks(positions, self.spec.ratio).max()) <= self.spec.keep

    def _write_index_keys(self, raw, row, cache: KVCache, layer: int) -> None:
        """A row of an indexed layer: its raw indexer keys raw [T, index_dim], and the keys of the
        blocks it completes."""
        x, start, end = self.indexer, row.start, row.start + len(row.tokens)
        cache.write_index_keys(layer, row.slot, start, raw)
        first, last = start // x.ratio, end // x.ratio
        if last > first:
            cache.write_index_blocks(layer, row.slot, first,
                                     x.pool(cache.read_index_keys(layer, row.slot, first * x.ratio, last * x.ratio), first))

    def _block_scores(self, q, positions, written, row, cache: KVCache, layer: int) -> torch.Tensor | None:
        """[T, n] the block scores of a QSA row's queries q (the indexer's, where the layer has one)
        standing at `positions` (their keys `written` there, a tree's siblings past the chain),
        engine/model/qsa.py's rule; None when none is past the budget (dense attention). A lone
        query then reads only its selected keys, a row of several (a verify block, a prompt chunk)
        the union of theirs, each query masked to its own: a verify block of a few tokens reads
        about the budget's keys, not the context's."""
        r, end = self.spec.ratio, row.start + len(row.tokens)
        if self._dense(positions):
            return None
        if self.indexer is not None:
            return qsa.scores(q, cache.read_index_blocks(layer, row.slot, end // r)[None])
        return qsa.pooled_scores(q, cache.read_pool(layer, row.slot, end // r), positions, written, r,
                                 lambda index: cache.read_at(layer, row.slot, index)[0])

    def _probe(self, q, k, batch: ForwardBatch, cache: KVCache, layer: int, selections: list) -> None:
        """Hand the probed rows' q and k, the keys they could attend and those they did (None: all
        before them), to their probes when this layer is one of theirs."""
        offset = 0
        for row, probe, selected in zip(batch.rows, batch.probes, selections):
            t = len(row.tokens)
            if probe is not None and layer in probe.layers:
                keys = cache.read(layer, row.slot, row.start + t)[0].to(q.dtype)
                probe.take(layer, row.start, q[offset:offset + t], k[offset:offset + t], keys, selected)
            offset += t

    def _attend(self, q, keys, values, mask, prefix: int = 0) -> torch.Tensor:
        """q [T, heads, d] against keys, values [kv_heads, L, d] under mask [T, L] (None: all);
        prefix: how many leading keys every query sees (a chain's chunk: the keys before it)."""
        # Grouped-query attention without repeating K/V: the `group` query heads that share a kv
        # head are stacked along the query axis. q: [T, heads, d] -> [kv_heads, group*T, d].
        t = q.shape[0]
        qg = q.view(t, self.kv_heads, self.group, self.head_dim).permute(1, 2, 0, 3)
        qg = qg.reshape(self.kv_heads, self.group * t, self.head_dim)
        if prefix and t > 1 and q.dtype == torch.float32 and q.is_cpu:
            o = _prefix_then_causal(qg[None], keys[None], values[None], prefix, self.group)
        else:
            if mask is not None:
                mask = mask.repeat(self.group, 1)
            # A leading batch axis: with 3-d inputs torch takes its slower reference path.
            o = F.scaled_dot_product_attention(qg[None], keys[None], values[None], attn_mask=mask)
        # [1, kv_heads, group*T, d] -> [T, heads, d]
        return o.view(self.kv_heads, self.group, t, self.head_dim).permute(2, 0, 1, 3).reshape(t, self.heads, self.head_dim)


_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@functools.lru_cache(maxsize=8)
def _causal_bias(t: int, group: int) -> torch.Tensor:
    """[group*t, t] additive mask of a chunk's own keys for its stacked query heads: 0 on and below
    the diagonal, -inf above."""
    return torch.full((t, t), float("-inf")).triu_(1).repeat(group, 1)


def _prefix_then_causal(q, keys, values, prefix: int, group: int) -> torch.Tensor:
    """A prompt chunk's attention in two parts, q [1, kv_heads, group*T, d] stacked by head: the
    `prefix` keys before it, which every query sees (no mask), and its own T keys (causal), their
    results merged by their log-sum-exps. One call under a [T, prefix + T] mask took 45% longer at
    5,200 keys on Zen 4 (torch's kernel reads the mask for every score); the same numbers within
    f32 rounding."""
    t = q.shape[2] // group
    o1, lse1 = _flash(q, keys[:, :, :prefix], values[:, :, :prefix], 0.0, False)[:2]
    o2, lse2 = _flash(q, keys[:, :, prefix:], values[:, :, prefix:], 0.0, False, attn_mask=_causal_bias(t, group))[:2]
    top = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - top).unsqueeze(-1), torch.exp(lse2 - top).unsqueeze(-1)
    return (o1 * w1 + o2 * w2) / (w1 + w2)
