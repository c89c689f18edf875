"""Where a Qwen4-Exp model's tensors lie in its files (an HF checkpoint, or a GGUF file as llama.cpp's
converter writes it, `qwen4exp`), and what tandem reads them as.

As for Qwen3.5 (engine/files/qwen3_5_layout.py, whose renames apply here too): every (1 + w) RMSNorm
is read as 1 + w (the hyper-connections', attention's q/k norms, the indexer's and the n-gram
embeddings' norms; the gated norm of a linear-attention layer scales by w itself), `A` as
-exp(A_log), depthwise convolutions as [channels, kernel]. Experts are per-expert tensors
(`mlp.experts.E.{gate,up,down}_proj.weight`); an n-gram table is `split_ngram_parts` shards of rows
(`ngram_embedding.shard_S.weight`), read as they are, never joined; the hash constants are int64
buffers, read exactly.

A GGUF file holds the same values under llama.cpp's names (`gguf_name`), with three differences of
form, each read as it is: the experts as three [experts, ...] tensors (`ffn_{gate,up,down}_exps`),
the indexer's projection as two (`indexer.q_proj`, `indexer.k_proj`), and one n-gram table for the
model (`per_layer_token_embd`; the converter writes one PLE layer) with its hash constants in the
metadata (engine/files/config_readers.py puts them in the config).
"""
from __future__ import annotations

import torch

from engine.files import qwen3_5_layout
from engine.files.model_config import ModelConfig

hf_name = qwen3_5_layout.hf_name
# The hash constants of a PLE layer's n-gram embedding: int64, never widened to floats.
HASH_CONSTANTS = ("layer_multipliers", "ngram_heads_offsets", "ngram_heads_vocab_sizes")


def hf_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A tensor's shape as tandem reads it (convolutions without their middle axis)."""
    return (shape[0], shape[2]) if name.endswith("conv1d.weight") and len(shape) == 3 else shape


def _offset_norm(name: str) -> bool:
    return name.endswith(("norm.weight", ".norm_key.weight", ".norm_query.weight", ".norm_conv.weight",
                          "pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight")) \
        and not name.endswith("linear_attn.norm.weight")


def is_ngram_table(name: str) -> bool:
    """Whether a tensor (tandem's name) is a shard of an n-gram table: read by row from the file's
    map, in the file's type, never copied whole (the real model's table is 27 GB)."""
    return ".ngram_embedding.shard_" in name


def adapt_hf(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """An HF checkpoint's tensor (under tandem's name) in the form tandem computes with; f32 but
    for the hash constants."""
    if name.endswith(HASH_CONSTANTS):
        return tensor.long()
    tensor = tensor.float()
    if _offset_norm(name):
        return 1.0 + tensor
    if name.endswith(".linear_attn.A"):
        return -tensor.exp()
    return tensor[:, 0] if name.endswith("conv1d.weight") and tensor.dim() == 3 else tensor


def hyper_shapes(c: ModelConfig, p: str, inject: bool = True) -> dict[str, tuple[int, ...]]:
    """A hyper-connection's tensors under p: its grouped norm, low-rank mix and injection weights."""
    wide = c.hc_count * c.hidden_size
    out = {p + "hc_norm.weight": (wide,), p + "input_mix_weight_down.weight": (c.hc_lowrank, wide),
           p + "input_mix_weight_up.weight": (wide, c.hc_lowrank)}
    if inject:
        out[p + "block_inject_weight.weight"] = (c.hc_count, wide)
    return out


def expert_shapes(c: ModelConfig, p: str, shapes: dict[str, tuple[int, ...]] = {}) -> dict[str, tuple[int, ...]]:
    """A layer's router, experts and shared expert under p (`mlp.`), the experts in the form the
    file (its `shapes`) holds them: one tensor per expert and projection; two [experts, ...]
    tensors, gate rows then up rows in `experts.gate_up_proj` (an HF checkpoint's MTP layer); or
    three (`experts.gate_proj`, `up_proj`, `down_proj`: GGUF)."""
    h, e = c.hidden_size, c.experts
    out = {p + "gate.weight": (e.count, h), p + "shared_expert_gate.weight": (1, h),
           p + "shared_expert.gate_proj.weight": (e.shared_intermediate, h),
           p + "shared_expert.up_proj.weight": (e.shared_intermediate, h),
           p + "shared_expert.down_proj.weight": (h, e.shared_intermediate)}
    if p + "experts.gate_up_proj" in shapes:
        return {**out, p + "experts.gate_up_proj": (e.count, 2 * e.intermediate, h),
                p + "experts.down_proj": (e.count, h, e.intermediate)}
    if p + "experts.gate_proj" in shapes:
        return {**out, p + "experts.gate_proj": (e.count, e.intermediate, h),
                p + "experts.up_proj": (e.count, e.intermediate, h), p + "experts.down_proj": (e.count, h, e.intermediate)}
    for k in range(e.count):
        out.update({p + f"experts.{k}.gate_proj.weight": (e.intermediate, h),
                    p + f"experts.{k}.up_proj.weight": (e.intermediate, h),
                    p + f"experts.{k}.down_proj.weight": (h, e.intermediate)})
    return out


def indexer_shapes(c: ModelConfig, p: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The indexer's tensors under p: its projection as one (HF) or as q and k (GGUF), its norms."""
    x = c.indexer
    norms = {p + "q_layernorm.weight": (x.head_dim,), p + "k_layernorm.weight": (x.head_dim,)}
    if p + "q_proj.weight" in shapes:
        return {**norms, p + "q_proj.weight": (x.heads * x.head_dim, c.hidden_size),
                p + "k_proj.weight": (x.head_dim, c.hidden_size)}
    return {**norms, p + "index_qk_proj.weight": ((x.heads + 1) * x.head_dim, c.hidden_size)}


def ngram_shapes(c: ModelConfig, p: str, shards: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """A PLE layer's tensors under p, with its table's shards as the file holds them (`shards`:
    every shape the file has; the shards' count is the file's)."""
    g, wide = c.ngram, c.hc_count * c.hidden_size
    e = p + "ple_embedding."
    out = {p + "key_proj.weight": (wide, g.embed_dim), p + "value_proj.weight": (c.hidden_size, g.embed_dim),
           p + "norm_key.weight": (wide,), p + "norm_query.weight": (wide,), p + "norm_conv.weight": (wide,),
           p + "conv1d.weight": (wide, g.conv_kernel)}
    if not g.multipliers:  # an HF checkpoint's buffers (a GGUF file's are in the config)
        out.update({e + "layer_multipliers": (g.ngram,), e + "ngram_heads_offsets": (g.heads,),
                    e + "ngram_heads_vocab_sizes": (g.heads,)})
    out.update({name: shape for name, shape in shards.items() if name.startswith(e + "ngram_embedding.shard_")})
    return out


def trunk_shapes(c: ModelConfig, shards: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The trunk's tensors, in the forms the file holds (shards: every shape the file has)."""
    out = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
           **hyper_shapes(c, "model.hyper_connection_mixer.", inject=False)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for n in range(c.num_layers):
        p = f"model.layers.{n}."
        out.update(hyper_shapes(c, p + "attn_hyper_connection."))
        out.update(hyper_shapes(c, p + "mlp_hyper_connection."))
        out.update(expert_shapes(c, p + "mlp.", shards))
        if c.is_recurrent(n):
            block = qwen3_5_layout.block_shapes(c, p, True)
            out.update({k: v for k, v in block.items() if ".linear_attn." in k})
        else:
            out.update(qwen3_5_layout.attention_shapes(c, p))
            if c.indexer is not None:
                out.update(indexer_shapes(c, p + "self_attn.indexer.", shards))
        if c.ngram is not None and n in c.ngram.layers:
            out.update(ngram_shapes(c, p + "ple.", shards))
    return out


def mtp_shapes(c: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The model's MTP layer (transformers drops it; docs/architecture.md, "Qwen4-Exp's own MTP"):
    the projections of the embedding and of each residual stream, their norms (the hidden's over all
    streams), a full-attention layer with its hyper-connections and experts (per-expert or merged,
    as `shapes`, the file's, has them), and its own stream mixer. Its indexer's tensors, which a
    checkpoint may hold, are not read: the layer attends densely."""
    h, wide = c.hidden_size, c.residual_width
    # A GGUF holds the two projections as one, [fc_embedding | fc_hidden] along its input.
    fc = {"mtp.fc.weight": (h, 2 * h)} if "mtp.fc.weight" in shapes else \
        {"mtp.fc_embedding.weight": (h, h), "mtp.fc_hidden.weight": (h, h)}
    out = {**fc, "mtp.pre_fc_norm_embedding.weight": (h,), "mtp.pre_fc_norm_hidden.weight": (wide,),
           **hyper_shapes(c, "mtp.hyper_connection_mixer.", inject=False)}
    for k in range(c.num_nextn_predict_layers):
        p = f"mtp.layers.{k}."
        out.update(hyper_shapes(c, p + "attn_hyper_connection."))
        out.update(hyper_shapes(c, p + "mlp_hyper_connection."))
        out.update(qwen3_5_layout.attention_shapes(c, p))
        out.update(expert_shapes(c, p + "mlp.", shapes))
    return out


_GGUF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output.weight": "lm_head.weight",
                "output_hc_norm.weight": "model.hyper_connection_mixer.hc_norm.weight",
                "output_hc_down.weight": "model.hyper_connection_mixer.input_mix_weight_down.weight",
                "output_hc_up.weight": "model.hyper_connection_mixer.input_mix_weight_up.weight"}
_HYPER = {"norm": "hc_norm", "down": "input_mix_weight_down", "up": "input_mix_weight_up", "inject": "block_inject_weight"}
_GGUF_LAYER = {
    **{f"hc_{g}_{part}.weight": f"{block}_hyper_connection.{name}.weight"
       for g, block in (("attn", "attn"), ("ffn", "mlp")) for part, name in _HYPER.items()},
    "indexer.q_proj.weight": "self_attn.indexer.q_proj.weight",
    "indexer.k_proj.weight": "self_attn.indexer.k_proj.weight",
    "indexer.q_norm.weight": "self_attn.indexer.q_layernorm.weight",
    "indexer.k_norm.weight": "self_attn.indexer.k_layernorm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight", "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    **{f"ffn_{n}_shexp.weight": f"mlp.shared_expert.{n}_proj.weight" for n in ("gate", "up", "down")},
    **{f"ffn_{n}_exps.weight": f"mlp.experts.{n}_proj" for n in ("gate", "up", "down")},
    **{f"ple_{n}.weight": f"ple.{n}_proj.weight" for n in ("key", "value")},
    **{f"ple_norm_{n}.weight": f"ple.norm_{n}.weight" for n in ("key", "query", "conv")},
    "ple_conv1d.weight": "ple.conv1d.weight",
}


def gguf_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A GGUF tensor's shape as tandem reads it (tandem's name): the shared expert's gate is one
    row, which llama-quantize may store as a vector."""
    return (1, shape[0]) if name.endswith("shared_expert_gate.weight") and len(shape) == 1 else shape


# The MTP layer's own tensors in an MTP-only GGUF (blk.N.nextn.*, N the trunk's layer count), as
# llama.cpp's qwen4exp MTP export writes them: the combiner's two projections as one eh_proj, the
# head's stream mixer per block.
_GGUF_NEXTN = {"nextn.eh_proj.weight": "mtp.fc.weight", "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
               "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight",
               **{f"nextn.hc_head_{part}.weight": f"mtp.hyper_connection_mixer.{name}.weight"
                  for part, name in _HYPER.items() if part != "inject"}}


def gguf_name(name: str, trunk: int, ple_layers: tuple[int, ...]) -> str | None:
    """tandem's name of a qwen4exp GGUF tensor, None for one it does not read. The model's one
    n-gram table is its PLE layer's; blocks past the trunk are its MTP layers."""
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    if name == "per_layer_token_embd.weight" and ple_layers:
        return f"model.layers.{ple_layers[0]}.ple.ple_embedding.ngram_embedding.shard_0.weight"
    parts = name.split(".", 2)
    if parts[0] != "blk" or len(parts) != 3 or not parts[1].isdecimal():
        return None
    layer, rest = int(parts[1]), parts[2]
    if layer >= trunk and rest in _GGUF_NEXTN:
        return _GGUF_NEXTN[rest]
    own = _GGUF_LAYER.get(rest) or qwen3_5_layout.GGUF_LAYER.get(rest)
    if own is None:
        return None
    return f"model.layers.{layer}.{own}" if layer < trunk else f"mtp.layers.{layer - trunk}.{own}"
