"""Qwen4-Exp's decoder layer (docs/architecture.md, "Qwen4-Exp"), as transformers' Qwen4ExpTextDecoderLayer
computes it: on `hc_count` residual streams [N, hc * hidden], the layer's n-gram embeddings (PLE
layers) are added first; then its mixer (gated attention with the model's QSA indexer, or a Gated
DeltaNet) and its experts each run inside a hyper-connection, which gives them one mixed [N, hidden]
input and adds their output back to every stream.

A decode step (one token a slot) runs a stack of these layers in one kernel call, tandem's
Qwen4ExpLayers (engine/ops/csrc/qwen4_exp_layers.cpp), which calls the kernels these modules call
in their order: the same numbers without the interpreter between them (`fused_layers`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.files.model_config import ModelConfig
from engine.model.attention import Attention
from engine.model.batch import ForwardBatch
from engine.model.experts import Experts
from engine.model.gated_delta import GatedDeltaNet
from engine.model.hyper_connections import HyperConnection
from engine.model.kv_cache import KVCache
from engine.model.layer_spec import LayerSpec
from engine.model.ngram_embedding import NgramEmbedding
from engine.ops.quant import Linear


class Qwen4ExpLayer(nn.Module):
    def __init__(self, c: ModelConfig, t: dict, index: int, dtype: str, spec: LayerSpec,
                 rope: tuple[torch.Tensor, torch.Tensor], model_index: int):
        """index: the layer's in t and in the cache; model_index: in the model (which layers have
        n-gram embeddings)."""
        super().__init__()
        p = f"model.layers.{index}."
        self.index, self.spec = index, spec
        self.ple = NgramEmbedding(c, t, p + "ple.", dtype) if c.ngram and model_index in c.ngram.layers else None
        self.attn_hyper_connection = HyperConnection(c, t, p + "attn_hyper_connection.", dtype)
        self.self_attn = None if spec.is_recurrent else Attention(c, t, p + "self_attn.", dtype, spec, rope)
        self.linear_attn = GatedDeltaNet(c, t, p + "linear_attn.", dtype) if spec.is_recurrent else None
        self.mlp_hyper_connection = HyperConnection(c, t, p + "mlp_hyper_connection.", dtype)
        self.mlp = Experts(c, t, p + "mlp.", dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, cos, sin, cache: KVCache) -> torch.Tensor:
        """x [N, hc * hidden] -> [N, hc * hidden]."""
        if self.ple is not None:
            x = x + self.ple(x, batch, cache.recurrent, self.index)
        if self.linear_attn is not None:
            x = self.attn_hyper_connection(x, lambda h: self.linear_attn(h, batch, cache.recurrent, self.index))
        else:
            x = self.attn_hyper_connection(x, lambda h: self.self_attn(h, batch, cos, sin, cache, self.index))
        return self.mlp_hyper_connection(x, self.mlp)


class StreamMixer(HyperConnection):
    """The model's last hyper-connection: the streams [N, hc * hidden] mixed into the [N, hidden]
    states the lm_head reads (in place of a final norm)."""

    def __init__(self, c: ModelConfig, t: dict, dtype: str):
        super().__init__(c, t, "model.hyper_connection_mixer.", dtype, inject=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(x)[0]



@dataclass(frozen=True)
class _Stack:
    """A stack of Qwen4-Exp layers as Qwen4ExpLayers runs it, built once per stack and cache (the
    weights and the cache's storage stay where they are)."""
    first: nn.Module  # the stack's first layer, kept alive so that its id names the stack
    runs: list[tuple[NgramEmbedding | None, int, object]]  # (n-gram embedding first, its layer, the kernel's stack)
    rules: tuple[tuple[int, int], ...]  # the QSA layers' (ratio, blocks kept)
    sparse: bool  # whether a QSA row past its budget can take the call (K and V in f32)
    max_rows: int  # the most rows every linear layer's kernel takes

    def takes(self, batch: ForwardBatch, rows: int) -> bool:
        """Whether the step is the kernel's: decode rows only, each QSA layer's rows all within its
        budget or all past it (the module's one decode_attention call, or its rows one by one)."""
        if rows > self.max_rows or len(batch.decode_index) != rows or batch.rope_positions is not None:
            return False
        if self.rules:
            positions = [row.start for row in batch.rows]
            for ratio, keep in self.rules:
                past = sum((p + 1) // ratio > keep for p in positions)
                if past and (past < len(positions) or not self.sparse):
                    return False
        return True


def fused_layers(stack: _Stack | None, x: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor,
                 cache: KVCache) -> torch.Tensor | None:
    """x [N, hc * hidden] through a stack of layers (`build_stack`'s) in Qwen4ExpLayers calls (an
    n-gram embedding, between them, added by its module), when the step is the kernel's
    (`_Stack.takes`); None when it is not. The caller has checked the kernels, probes and hooks.
    cos, sin: [N, R]."""
    if stack is None or not stack.takes(batch, x.shape[0]):
        return None
    for ple, index, run in stack.runs:
        if ple is not None:
            x = x + ple(x, batch, cache.recurrent, index)
        x = run.forward(x, batch.slots, batch.positions, cos, sin)
    return x


def _linear(m: Linear | None) -> list[torch.Tensor | None]:
    return [m.weight, m.scale, m.bias] if m is not None else [None] * 3


def _weight(m: nn.Module | None) -> torch.Tensor | None:
    return None if m is None else m.weight


def build_stack(layers: list[Qwen4ExpLayer], cache: KVCache, dtype: torch.dtype) -> _Stack | None:
    # attend_at reads f32 rows; a QSA layer without the model's indexer (--compress-ratios) pools
    # attention keys, which the kernel does not.
    if dtype != torch.float32 or any(layer.self_attn is not None and layer.spec.is_qsa and
                                     layer.self_attn.indexer is None for layer in layers):
        return None
    recurrent = cache.recurrent
    if recurrent is not None and not recurrent.per_token(1):
        return None
    first_attention = next((layer.self_attn for layer in layers if layer.self_attn is not None), None)
    first_linear = next((layer.linear_attn for layer in layers if layer.linear_attn is not None), None)
    indexer = next((layer.self_attn.indexer for layer in layers
                    if layer.self_attn is not None and layer.self_attn.indexer is not None), None)
    epsilons, pages, sparse = set(), None, True
    weights, stores, flags = [], [], []
    for layer in layers:
        hypers = (layer.attn_hyper_connection, layer.mlp_hyper_connection)
        epsilons.update(h.hc_norm.eps for h in hypers)
        a, g = layer.self_attn, layer.linear_attn
        if a is not None:
            view = cache.kernel_view(layer.index, dtype)
            if view is None:
                return None
            pages = view.pages
            sparse = sparse and view.k_scale is None
            ix = a.indexer
            norms = [n for n in (a.q_norm, a.k_norm) + ((ix.q_norm, ix.k_norm) if ix is not None else ()) if n is not None]
            epsilons.update(n.eps for n in norms)
            mixer = [*_linear(a.qkv_proj), _weight(a.q_norm), _weight(a.k_norm), *_linear(a.o_proj),
                     *_linear(ix and ix.proj), _weight(ix and ix.q_norm), _weight(ix and ix.k_norm)]
            qsa = layer.spec.is_qsa
            stores += [view.k, view.v, view.k_scale, view.v_scale,
                       cache.ikeys[layer.index] if qsa else None, cache.iblocks[layer.index] if qsa else None]
            flags += [1, layer.spec.ratio if qsa else 0, layer.spec.keep if qsa else 0]
            q8 = [a.qkv_proj.q8_activations, a.o_proj.q8_activations, ix is not None and ix.proj.q8_activations]
        else:
            epsilons.add(g.norm.eps)
            j = recurrent.layers[layer.index]
            mixer = [*g.kernel_weights, g.conv_weight, g.A, g.dt_bias, g.k_head, g.norm.weight,
                     recurrent.conv[j], recurrent.state[j]]
            stores += [None] * 6
            flags += [0, 0, 0]
            q8 = [g.in_proj.q8_activations or g.out_proj.q8_activations, False, False]
        weights += [t for h in hypers for t in (h.hc_norm.weight, *h._kernel_weights)] + mixer + layer.mlp.kernel_weights
        flags += [hypers[0]._q8(), hypers[1]._q8(), *q8, layer.mlp.q8_activations]
    if len(epsilons) != 1:
        return None
    a, e = first_attention, layers[0].mlp.config
    dims = [layers[0].attn_hyper_connection.streams, a.heads if a else 1, a.kv_heads if a else 1,
            a.head_dim if a else 1, indexer.heads if indexer else 0, indexer.head_dim if indexer else 0,
            e.top_k, e.norm_top_k, first_linear is not None and first_linear.sigmoid_gate]
    cos, sin = (indexer.cos, indexer.sin) if indexer is not None else (torch.empty(0, 0), torch.empty(0, 0))
    per_layer = len(weights) // len(layers)
    starts = [i for i, layer in enumerate(layers) if i == 0 or layer.ple is not None] + [len(layers)]
    eps = epsilons.pop()
    runs = [(layers[begin].ple, layers[begin].index, torch.classes.tandem.Qwen4ExpLayers(
        weights[begin * per_layer:end * per_layer], stores[begin * 6:end * 6], [int(f) for f in flags[begin * 9:end * 9]],
        [int(d) for d in dims], eps, pages, cos, sin)) for begin, end in zip(starts, starts[1:])]
    rules = tuple(sorted({(layer.spec.ratio, layer.spec.keep) for layer in layers
                          if layer.self_attn is not None and layer.spec.is_qsa}))
    max_rows = min(m.max_kernel_rows for layer in layers for m in layer.modules() if isinstance(m, Linear))
    return _Stack(layers[0], runs, rules, sparse, max_rows)
