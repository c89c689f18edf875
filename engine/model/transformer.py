"""The decoder-only model every family here is: Llama, Mistral, Qwen2, Qwen3 (attention layers) and
Qwen3.5 (attention and Gated DeltaNet layers, engine/model/gated_delta.py).

Tokens of all rows of a step run through the linear layers together as one [N, hidden] matrix;
attention runs per row, over views of that row's slot in the KV cache. A step of a few tokens
(decode, verify) runs every layer of a CPU stage in one call of tandem's kernel instead
(`fused_layers`). The trunk's layers sit in stages, one per device (engine/placement.py): the
hidden states move from stage to stage.
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from engine.files.model_config import ModelConfig
from engine.model.attention import Attention
from engine.model.batch import NO_ROWS, ForwardBatch
from engine.model.gated_delta import GatedDeltaNet
from engine.model.kv_cache import KernelView, KVCache
from engine.model.layer_spec import LayerSpec, trunk_specs
from engine.model.mlp import MLP
from engine.model.norm import RMSNorm
from engine.model import qwen4_exp
from engine.model.qwen4_exp import Qwen4ExpLayer, StreamMixer
from engine.model.rope import rope_table
from engine.ops import kernels
from engine.ops.arena import move_to_huge_pages
from engine.ops.quant import FormatUse, Linear, compute_dtype, weight_formats
from engine.placement import Placement


class DecoderLayer(nn.Module):
    """Layer `index` of its model's cache: a token mixer, then an MLP, each after its RMSNorm and
    added back. `spec` says which mixer (attention, dense or QSA; or Gated DeltaNet, recurrent),
    given by the caller for this layer alone, never looked up by index in a model-wide list."""

    def __init__(self, c: ModelConfig, t: dict, index: int, dtype: str, spec: LayerSpec):
        super().__init__()
        p = f"model.layers.{index}."
        cdt = compute_dtype(dtype)
        self.index, self.spec = index, spec
        self.input_layernorm = RMSNorm(t[p + "input_layernorm.weight"], c.rms_norm_eps, cdt)
        self.self_attn = None if spec.is_recurrent else Attention(c, t, p + "self_attn.", dtype, spec)
        self.linear_attn = GatedDeltaNet(c, t, p + "linear_attn.", dtype) if spec.is_recurrent else None
        self.post_attention_layernorm = RMSNorm(t[p + "post_attention_layernorm.weight"], c.rms_norm_eps, cdt)
        self.mlp = MLP(c, t, p + "mlp.", dtype)

    def forward(self, x, batch, cos, sin, cache) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.linear_attn is not None:
            x = x + self.linear_attn(h, batch, cache.recurrent, self.index)
        else:
            x = x + self.self_attn(h, batch, cos, sin, cache, self.index)
        return x + self.mlp(self.post_attention_layernorm(x))

    @functools.cached_property
    def kernel_weights(self) -> list[torch.Tensor | None]:
        """The layer's tensors in the order tandem's decoder_layers kernel reads them (a linear-
        attention layer's input projection and out_proj where an attention layer's qkv and o go)."""
        a, m, g = self.self_attn, self.mlp, self.linear_attn
        norms = [a.q_norm.weight, a.k_norm.weight] if a is not None and a.q_norm is not None else [None, None]
        mixer = [*_linear(g.in_proj), *norms, *_linear(g.out_proj)] if g is not None else \
            [*_linear(a.qkv_proj), *norms, *_linear(a.o_proj)]
        return [self.input_layernorm.weight, *mixer, self.post_attention_layernorm.weight, *_linear(m.gate_up_proj),
                *_linear(m.down_proj)]

    def linear_kernel_tensors(self, cache: KVCache) -> list[torch.Tensor | None]:
        """A linear-attention layer's own tensors and stores as decoder_layers reads them; 7 None for
        an attention layer."""
        g = self.linear_attn
        if g is None:
            return [None] * 7
        j = cache.recurrent.layers[self.index]
        return [g.conv_weight, g.A, g.dt_bias, g.k_head, g.norm.weight, cache.recurrent.conv[j], cache.recurrent.state[j]]


def decoder_layer(c: ModelConfig, t: dict, index: int, dtype: str, spec: LayerSpec,
                  rope: tuple[torch.Tensor, torch.Tensor], model_index: int | None = None) -> nn.Module:
    """The layer whose tensors are t's `model.layers.{index}.`: the model's layer `model_index`
    (default `index`; a pipeline worker renumbers its stage's layers from 0). rope: the cos and sin
    tables a layer with its model's QSA indexer reads."""
    if c.family == "qwen4_exp":
        return Qwen4ExpLayer(c, t, index, dtype, spec, rope, index if model_index is None else model_index)
    return DecoderLayer(c, t, index, dtype, spec)


def _linear(layer: Linear) -> list[torch.Tensor | None]:
    return [layer.weight, layer.scale, layer.bias]


@dataclass(frozen=True)
class StackArgs:
    """What decoder_layers reads of a stack of layers and its cache beyond the step's rows: the same
    every step (the weights and the cache's storage stay where they are), so built once. Rebuilding
    these lists took 0.3-0.4 ms of a 6 ms decode step of the default model's Q4_K_M file."""
    first: nn.Module  # the stack's first layer, kept alive so that its id names the stack
    weights: list[torch.Tensor | None]
    k: list[torch.Tensor]
    v: list[torch.Tensor]
    k_scales: list[torch.Tensor | None]
    v_scales: list[torch.Tensor | None]
    kpools: list[torch.Tensor | None]
    ratios: list[int]
    budgets: list[int]
    heads: int
    kv_heads: int
    eps: float
    pages: torch.Tensor | None
    linear: list[torch.Tensor | None] | None  # the linear-attention layers' tensors (None: attention only)
    max_rows: int  # the most rows the layers' linear kernels take


# Per cache, what each of its stacks' one call reads (StackArgs, or a family's own; None: the stack
# cannot take the call), by (first layer's id, layers, dtype).
_STACKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def stack_args(layers: list[nn.Module], cache: KVCache, dtype: torch.dtype, build=None):
    """build(layers, cache, dtype) once per stack and cache (default: decoder_layers' StackArgs)."""
    key = (id(layers[0]), len(layers), dtype)
    stacks = _STACKS.setdefault(cache, {})
    if key not in stacks:
        stacks[key] = (build or _build_stack_args)(layers, cache, dtype)
    return stacks[key]


def _build_stack_args(layers: list[DecoderLayer], cache: KVCache, dtype: torch.dtype) -> StackArgs | None:
    if not all(isinstance(layer, DecoderLayer) for layer in layers):  # a family of its own layer (Qwen4-Exp)
        return None
    attention = [layer for layer in layers if layer.self_attn is not None]
    views = {layer.index: cache.kernel_view(layer.index, dtype) for layer in attention}
    if any(view is None for view in views.values()):  # another dtype than x's, or K and V in different formats
        return None
    # A linear-attention layer has no K/V: an attention layer's view (or nothing) stands in, unread.
    stand_in = views[attention[0].index] if attention else KernelView(NO_ROWS, NO_ROWS, None, None)
    views = [views.get(layer.index, stand_in) for layer in layers]
    heads, kv_heads = (attention[0].self_attn.heads, attention[0].self_attn.kv_heads) if attention else (1, 1)
    recurrent = len(attention) < len(layers)
    return StackArgs(layers[0], [w for layer in layers for w in layer.kernel_weights], [view.k for view in views],
                     [view.v for view in views], [view.k_scale for view in views], [view.v_scale for view in views],
                     [view.kpool for view in views], [layer.spec.ratio for layer in layers],
                     [layer.spec.budget for layer in layers], heads, kv_heads, layers[0].input_layernorm.eps,
                     views[0].pages,
                     [t for layer in layers for t in layer.linear_kernel_tensors(cache)] if recurrent else None,
                     min(layer.mlp.gate_up_proj.max_kernel_rows for layer in layers))


def fused_layers(layers: list[DecoderLayer], x: torch.Tensor, batch: ForwardBatch, cos: torch.Tensor,
                 sin: torch.Tensor, cache: KVCache) -> torch.Tensor | None:
    """The layers over x [N, hidden] in one kernel call, when the step is a few tokens (at most the
    linear kernel's row limit) on a cache of the compute dtype or q8_0 (slot-major or paged); None when it is not, or
    when a layer has hooks (`python -m train` watches one) or a row probes (its chosen layers hand
    q to the probe): those run module by module. QSA layers take the call too, with their specs
    and the cache's pooled keys, and linear-attention layers with their states. cos, sin: [N, R],
    R the rotary dims."""
    if not kernels.usable(x) or batch.probes is not None or len(batch.slots) != batch.num_tokens \
            or any(layer._forward_pre_hooks or layer._forward_hooks for layer in layers):
        return None
    if isinstance(layers[0], Qwen4ExpLayer):
        return qwen4_exp.fused_layers(stack_args(layers, cache, x.dtype, qwen4_exp.build_stack), x, batch, cos, sin,
                                      cache)
    a = stack_args(layers, cache, x.dtype)
    if a is None or (a.linear is not None and batch.rope_positions is not None) or batch.num_tokens > a.max_rows:
        return None
    return kernels.decoder_layers(x, a.weights, a.k, a.v, a.k_scales, a.v_scales, a.kpools, a.ratios, a.budgets,
                                  batch.slots, batch.positions, cos, sin, a.heads, a.kv_heads, a.eps,
                                  batch.rope_positions, a.pages, a.linear, layers[0].mlp.gate_up_proj.q8_activations)


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
        # Kept on the CPU, indexed by the step's positions there; each stage takes its rows along.
        cos, sin = rope_table(config.rope, config.rotary_dim, max_positions or config.max_position_embeddings)
        self.register_buffer("cos", cos.to(self.compute_dtype))
        self.register_buffer("sin", sin.to(self.compute_dtype))

        self.stages = nn.ModuleList(
            Stage([decoder_layer(config, tensors, i, dtype, spec, (self.cos, self.sin))
                   for i, spec in zip(layers, trunk_specs(config, layers))],
                  device, s == 0, s == len(ranges) - 1)
            for s, (device, layers) in enumerate(zip(self.placement.devices, ranges)))
        first, last = self.stages[0].device, self.stages[-1].device
        head = tensors["model.embed_tokens.weight"] if config.tie_word_embeddings else tensors["lm_head.weight"]
        self.lm_head = Linear(head, None, dtype).to(last)
        # A tied embedding on the lm_head's device is read from the lm_head's (possibly quantized)
        # rows: one copy in memory. A first stage on another device gets its own copy, in the same
        # format, so that it embeds exactly what the unsplit model does.
        tied_here = config.tie_word_embeddings and first == last
        self.embed = None if tied_here else embedding_table(config, tensors, dtype).to(first)
        # The final norm. A model with residual streams hands them out as they are (its MTP layer
        # reads them) and mixes them into one where the lm_head reads them (`logits`).
        self.norm = nn.Identity() if config.hc_count else \
            RMSNorm(tensors["model.norm.weight"], config.rms_norm_eps, self.compute_dtype).to(last)
        self.mixer = StreamMixer(config, tensors, dtype).to(last) if config.hc_count else None
        move_to_huge_pages(self)

    @property
    def layers(self) -> list[DecoderLayer]:
        """Every trunk layer, in order, across the stages."""
        return [layer for stage in self.stages for layer in stage.layers]

    @property
    def specs(self) -> list[LayerSpec]:
        return [layer.spec for layer in self.layers]

    def weight_formats(self) -> dict[str, FormatUse]:
        return weight_formats(self)  # an embedding copy is a Linear of its own: counted with the rest

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        """[N] token ids -> [N, hidden] in the compute dtype, on the first stage's device."""
        return embed_rows(self.lm_head if self.embed is None else self.embed, ids, self.compute_dtype)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Runs the batch, writing its K/V into the cache. Returns hidden states after the final
        norm, [N, hidden] (a model with residual streams: the streams, [N, hc * hidden]), on the last
        stage's device: the vectors that feed the lm_head (`logits`) and the MTP draft."""
        return self.norm(self.trunk(batch, cache, self.stages))

    def trunk(self, batch: ForwardBatch, cache: KVCache, stages) -> torch.Tensor:
        """The batch embedded and run through `stages` (all, or a pipeline head's own), writing their
        K/V: hidden states before the final norm, [N, hidden], where the last of them leaves them."""
        x = self.embed_tokens(batch.token_ids)
        if self.config.hc_count:  # every residual stream starts as the embedding
            x = x.repeat(1, self.config.hc_count)
        cos, sin = self.cos[batch.rope], self.sin[batch.rope]
        cache.begin_rows(batch.rows)
        for stage in stages:
            x = stage.run(x, batch, cos, sin, cache)
        cache.end_rows(batch.rows)
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, hidden] (or residual streams) as forward gives them (on any device) -> [rows, vocab]
        f32 on the CPU."""
        hidden = hidden.to(self.lm_head.weight.device)
        return self.head_logits(self.mixer(hidden) if self.mixer is not None else hidden)

    @torch.inference_mode()
    def head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head alone: [rows, hidden] -> [rows, vocab] f32 on the CPU (the model's own MTP layers
        share it)."""
        return self.lm_head(hidden.to(self.lm_head.weight.device)).float().cpu()
