"""The decoder-only transformer shared by the Llama, Mistral, Qwen2 and Qwen3 families.

Tokens of all rows of a step run through the linear layers together as one [N, hidden] matrix;
attention runs per row, over views of that row's slot in the KV cache. A step of a few tokens
(decode, verify) runs every layer of a CPU stage in one call of tandem's kernel instead
(`fused_layers`). The trunk's layers sit in stages, one per device (engine/placement.py): the
hidden states move from stage to stage.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.files.model_config import ModelConfig
from engine.model import qsa
from engine.model.batch import ForwardBatch
from engine.model.kv_cache import KVCache
from engine.model.qsa import LayerSpec
from engine.model.rope import rope_table, rotate
from engine.ops import blocks, kernels
from engine.ops.arena import move_to_huge_pages
from engine.ops.quant import FormatUse, Linear, compute_dtype, weight_formats
from engine.placement import Placement


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", weight.to(dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.usable(x):
            return kernels.rms_norm(x, self.weight, self.eps)
        # Normalised in f32, rounded to x's dtype, then scaled: the reference's order of operations.
        return self.weight * F.rms_norm(x.float(), x.shape[-1:], eps=self.eps).to(x.dtype)


# Projections that read the same input run as one matrix; their checkpoint names, in order.
FUSED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
         "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def fused_linear(t: dict, p: str, fused: str, with_bias: bool, dtype: str) -> Linear:
    parts = [p + name for name in FUSED[fused]]
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


class Attention(nn.Module):
    def __init__(self, c: ModelConfig, t: dict, p: str, dtype: str, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        self.qkv_proj = fused_linear(t, p[:-len("self_attn.")], "self_attn.qkv_proj", c.attention_bias, dtype)
        self.o_proj = Linear(t[p + "o_proj.weight"], None, dtype)
        cdt = compute_dtype(dtype)
        self.q_norm = RMSNorm(t[p + "q_norm.weight"], c.rms_norm_eps, cdt) if c.qk_norm else None
        self.k_norm = RMSNorm(t[p + "k_norm.weight"], c.rms_norm_eps, cdt) if c.qk_norm else None
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.group = c.num_heads // c.num_kv_heads

    def forward(self, x, batch: ForwardBatch, cos, sin, cache: KVCache, layer: int) -> torch.Tensor:
        n, heads = x.shape[0], self.heads
        qkv = self.qkv_proj(x).view(n, heads + 2 * self.kv_heads, self.head_dim)
        qk = qkv[:, :heads + self.kv_heads]
        if self.q_norm is not None:
            qk = torch.cat([self.q_norm(qk[:, :heads]), self.k_norm(qk[:, heads:])], dim=1)
        qk = rotate(qk, cos, sin)  # q and k in one pass
        q, k, v = qk[:, :heads], qk[:, heads:], qkv[:, heads + self.kv_heads:]
        out = torch.empty_like(q)
        # Rows of one token of a dense layer go through one kernel call when the cache holds floats
        # of q's dtype or q8_0; the others (prompt chunks, verify rows, QSA layers) attend row by row.
        store = cache.kernel_view(layer, q.dtype) if kernels.usable(q) and len(batch.decode_index) \
            and not self.spec.is_qsa else None
        if store is not None:
            i, slots, positions = batch.decode_index, batch.decode_slots, batch.decode_positions
            if len(i) == n:  # every row decodes: views, not gathers
                i = slice(None)
            cache.write_tokens(layer, slots, positions, k[i], v[i])
            out[i] = kernels.decode_attention(q[i], store.k, store.v, slots, positions + 1, self.head_dim ** -0.5,
                                              pages=store.pages, k_scale=store.k_scale, v_scale=store.v_scale)
        cache_dtype = cache.k[layer].dtype
        offset = 0
        for row, mask in zip(batch.rows, batch.masks):
            t = len(row.tokens)
            sl = slice(offset, offset + t)
            offset += t
            if t == 1 and store is not None:
                continue
            cache.write(layer, row.slot, row.start, k[sl].transpose(0, 1).to(cache_dtype),
                        v[sl].transpose(0, 1).to(cache_dtype))
            keys, values = cache.read(layer, row.slot, row.start + t)
            if self.spec.is_qsa:
                pool = cache.read_pool(layer, row.slot, (row.start + t) // self.spec.ratio)
                keys, values, mask = qsa.sparse_keys(q[sl], keys, values, pool, batch.rope[sl], self.spec, mask)
            out[sl] = self._attend(q[sl], keys.to(q.dtype), values.to(q.dtype), mask)
        if batch.probes is not None:
            self._probe(q, k, batch, cache, layer)
        return self.o_proj(out.view(n, heads * self.head_dim))

    def _probe(self, q, k, batch: ForwardBatch, cache: KVCache, layer: int) -> None:
        """Hand the probed rows' q and k, and the keys they attended, to their probes when this
        layer is one of theirs."""
        offset = 0
        for row, probe in zip(batch.rows, batch.probes):
            t = len(row.tokens)
            if probe is not None and layer in probe.layers:
                end = row.start + t
                keys = cache.read(layer, row.slot, end)[0].to(q.dtype)
                kpool = cache.read_pool(layer, row.slot, end // self.spec.ratio) if self.spec.is_qsa else None
                probe.take(layer, row.start, q[offset:offset + t], k[offset:offset + t], keys, self.spec, kpool)
            offset += t

    def _attend(self, q, keys, values, mask) -> torch.Tensor:
        # Grouped-query attention without repeating K/V: the `group` query heads that share a kv
        # head are stacked along the query axis. q: [T, heads, d] -> [kv_heads, group*T, d].
        t = q.shape[0]
        qg = q.view(t, self.kv_heads, self.group, self.head_dim).permute(1, 2, 0, 3)
        qg = qg.reshape(self.kv_heads, self.group * t, self.head_dim)
        if mask is not None:
            mask = mask.repeat(self.group, 1)
        # A leading batch axis: with 3-d inputs torch takes its slower reference path.
        o = F.scaled_dot_product_attention(qg[None], keys[None], values[None], attn_mask=mask)
        # [1, kv_heads, group*T, d] -> [T, heads, d]
        return o.view(self.kv_heads, self.group, t, self.head_dim).permute(2, 0, 1, 3).reshape(t, self.heads, self.head_dim)


class MLP(nn.Module):
    def __init__(self, c: ModelConfig, t: dict, p: str, dtype: str):
        super().__init__()
        self.gate_up_proj = fused_linear(t, p[:-len("mlp.")], "mlp.gate_up_proj", c.mlp_bias, dtype)
        self.down_proj = Linear(t[p + "down_proj.weight"], t.get(p + "down_proj.bias") if c.mlp_bias else None, dtype)
        self.inter = c.intermediate_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.inter, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Layer `index` of its model's cache; `spec` says how it attends (dense or QSA), given by the
    caller for this layer alone, never looked up by index in a model-wide list."""

    def __init__(self, c: ModelConfig, t: dict, index: int, dtype: str, spec: LayerSpec):
        super().__init__()
        p = f"model.layers.{index}."
        cdt = compute_dtype(dtype)
        self.index = index
        self.input_layernorm = RMSNorm(t[p + "input_layernorm.weight"], c.rms_norm_eps, cdt)
        self.self_attn = Attention(c, t, p + "self_attn.", dtype, spec)
        self.post_attention_layernorm = RMSNorm(t[p + "post_attention_layernorm.weight"], c.rms_norm_eps, cdt)
        self.mlp = MLP(c, t, p + "mlp.", dtype)

    def forward(self, x, batch, cos, sin, cache) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), batch, cos, sin, cache, self.index)
        return x + self.mlp(self.post_attention_layernorm(x))

    @functools.cached_property
    def kernel_weights(self) -> list[torch.Tensor | None]:
        """The layer's tensors in the order tandem's decoder_layers kernel reads them."""
        a, m = self.self_attn, self.mlp
        norms = [a.q_norm.weight, a.k_norm.weight] if a.q_norm is not None else [None, None]
        return [self.input_layernorm.weight, *_linear(a.qkv_proj), *norms, *_linear(a.o_proj),
                self.post_attention_layernorm.weight, *_linear(m.gate_up_proj), *_linear(m.down_proj)]


def _linear(layer: Linear) -> list[torch.Tensor | None]:
    return [layer.weight, layer.scale, layer.bias]


def fused_layers(layers: list[DecoderLayer], x: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor,
                 sin: torch.Tensor, cache: KVCache) -> torch.Tensor | None:
    """The layers over x [N, hidden] in one kernel call, when the step is a few tokens (at most the
    linear kernel's row limit) on a cache of the compute dtype or q8_0 (slot-major or paged); None when it is not, or
    when a layer has hooks (`python -m train` watches one) or a row probes (its chosen layers hand
    q to the probe): those run module by module. QSA layers take the call too, with their specs
    and the cache's pooled keys. cos, sin: [N, head_dim]."""
    first = layers[0]
    if not kernels.usable(x) or batch.probes is not None or len(batch.slots) != batch.num_tokens \
            or batch.num_tokens > first.self_attn.qkv_proj.max_kernel_rows \
            or any(layer._forward_pre_hooks or layer._forward_hooks for layer in layers):
        return None
    views = [cache.kernel_view(layer.index, x.dtype) for layer in layers]
    if any(view is None for view in views):  # another dtype than x's, or K and V in different formats
        return None
    a = first.self_attn
    weights = [w for layer in layers for w in layer.kernel_weights]
    specs = [layer.self_attn.spec for layer in layers]
    return kernels.decoder_layers(x, weights, [view.k for view in views], [view.v for view in views],
                                  [view.k_scale for view in views], [view.v_scale for view in views],
                                  [view.kpool for view in views], [spec.ratio for spec in specs],
                                  [spec.budget for spec in specs], batch.slots, batch.positions, cos, sin,
                                  a.heads, a.kv_heads, first.input_layernorm.eps, batch.rope_positions,
                                  views[0].pages)


def run_layers(layers: list[DecoderLayer], x: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor,
               sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """x [N, hidden] through the layers: in one kernel call where `fused_layers` takes the step,
    else module by module. cos, sin: [N, head_dim]."""
    fused = fused_layers(layers, x, batch, cos, sin, cache)
    if fused is not None:
        return fused
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [N, 1, head_dim]
    for layer in layers:
        x = layer(x, batch, cos, sin, cache)
    return x


def run_on(device: torch.device, layers: list[DecoderLayer], x: torch.Tensor, batch: ForwardBatch,
           cos: torch.Tensor, sin: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """`run_layers` on the device the layers (and their cache) sit on, whatever device x, the
    batch and cos, sin [N, head_dim] come from; returns x there."""
    return run_layers(layers, x.to(device), batch.on(device), cos.to(device), sin.to(device), cache)


def embedding_table(config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: str) -> Linear:
    """The token embedding as rows to look up: a tied one in the weight format (the rows the lm_head
    holds, so a copy embeds exactly what the lm_head's rows do), an untied one in the compute dtype."""
    table = tensors["model.embed_tokens.weight"]
    if config.tie_word_embeddings:
        return Linear(table, None, dtype)
    return Linear(table, None, "bf16" if compute_dtype(dtype) == torch.bfloat16 else "f32")


def embed_rows(table: Linear, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N] token ids (on any device) -> [N, hidden] in `dtype`, on the table's device."""
    return table.rows(ids.to(table.weight.device)).to(dtype)


class Stage(nn.Module):
    """Consecutive trunk layers on one device, with their global indices (the cache's layers).
    On the CPU they run through tandem's kernels where a step takes them; elsewhere on torch's ops."""

    def __init__(self, layers: list[DecoderLayer], device: str, first: bool, last: bool):
        super().__init__()
        self.device = torch.device(device)
        self.layers = nn.ModuleList(layer.to(self.device) for layer in layers)
        self.first, self.last = first, last  # whether it holds the embedding, or the final norm and lm_head

    def run(self, x: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor,
            cache: KVCache) -> torch.Tensor:
        """x [N, hidden] from wherever the previous stage left it, through this stage's layers on its
        device, writing their K/V; returns x there. cos, sin: [N, head_dim]."""
        return run_on(self.device, self.layers, x, batch, cos, sin, cache)


class Transformer(nn.Module):
    """Built from tensors under HF names, f32 or (linear weights) GGUF blocks; `dtype` is the weight
    format (engine.settings.DTYPES), each linear weight's own as engine.ops.quant.stored_format says;
    `placement` puts the layers in stages (default: one stage on the CPU)."""

    def __init__(self, config: ModelConfig, tensors: dict[str, torch.Tensor], dtype: str = "f32",
                 max_positions: int | None = None, placement: Placement | None = None):
        super().__init__()
        self.config, self.dtype = config, dtype
        self.compute_dtype = compute_dtype(dtype)
        self.placement = placement or Placement.single(config.num_layers)
        ranges = self.placement.stage_ranges()
        self.stages = nn.ModuleList(
            Stage([DecoderLayer(config, tensors, i, dtype, LayerSpec.of(config.layer_ratios[i], config.qsa_budget))
                   for i in layers], device, s == 0, s == len(ranges) - 1)
            for s, (device, layers) in enumerate(zip(self.placement.devices, ranges)))
        first, last = self.stages[0].device, self.stages[-1].device
        head = tensors["model.embed_tokens.weight"] if config.tie_word_embeddings else tensors["lm_head.weight"]
        self.lm_head = Linear(head, None, dtype).to(last)
        # A tied embedding on the lm_head's device is read from the lm_head's (possibly quantized)
        # rows: one copy in memory. A first stage on another device gets its own copy, in the same
        # format, so that it embeds exactly what the unsplit model does.
        tied_here = config.tie_word_embeddings and first == last
        self.embed = None if tied_here else embedding_table(config, tensors, dtype).to(first)
        self.norm = RMSNorm(tensors["model.norm.weight"], config.rms_norm_eps, self.compute_dtype).to(last)
        # Kept on the CPU, indexed by the step's positions there; each stage takes its rows along.
        cos, sin = rope_table(config.rope, config.head_dim, max_positions or config.max_position_embeddings)
        self.register_buffer("cos", cos.to(self.compute_dtype))
        self.register_buffer("sin", sin.to(self.compute_dtype))
        move_to_huge_pages(self)

    @property
    def layers(self) -> list[DecoderLayer]:
        """Every trunk layer, in order, across the stages."""
        return [layer for stage in self.stages for layer in stage.layers]

    @property
    def specs(self) -> list[LayerSpec]:
        return [layer.self_attn.spec for layer in self.layers]

    def weight_formats(self) -> dict[str, FormatUse]:
        return weight_formats(self)  # an embedding copy is a Linear of its own: counted with the rest

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """[N] token ids -> [N, hidden] in the compute dtype, on the first stage's device."""
        return embed_rows(self.lm_head if self.embed is None else self.embed, ids, self.compute_dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Runs the batch, writing its K/V into the cache. Returns hidden states after the final
        norm, [N, hidden], on the last stage's device: the vectors that feed the lm_head (and the
        MTP draft)."""
        return self.norm(self.trunk(batch, cache, self.stages))

    def trunk(self, batch: ForwardBatch, cache: KVCache, stages) -> torch.Tensor:
        """The batch embedded and run through `stages` (all, or a pipeline head's own), writing their
        K/V: hidden states before the final norm, [N, hidden], where the last of them leaves them."""
        x = self.embed_tokens(batch.token_ids)
        cos, sin = self.cos[batch.rope], self.sin[batch.rope]
        for stage in stages:
            x = stage.run(x, batch, cos, sin, cache)
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] (on any device) -> [rows, vocab] f32 on the CPU."""
        return self.lm_head(hidden.to(self.lm_head.weight.device)).float().cpu()
