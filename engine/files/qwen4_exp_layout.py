"""Where a Qwen4-Exp model's tensors lie in its HF checkpoint, and what tandem reads them as.

As for Qwen3.5 (engine/files/qwen3_5_layout.py, whose renames apply here too): every (1 + w) RMSNorm
is read as 1 + w (the hyper-connections', attention's q/k norms, the indexer's and the n-gram
embeddings' norms; the gated norm of a linear-attention layer scales by w itself), `A` as
-exp(A_log), depthwise convolutions as [channels, kernel]. Experts are per-expert tensors
(`mlp.experts.E.{gate,up,down}_proj.weight`); an n-gram table is `split_ngram_parts` shards of rows
(`ngram_embedding.shard_S.weight`), read as they are, never joined; the hash constants are int64
buffers, read exactly.
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
    return name.endswith(("norm.weight", ".norm_key.weight", ".norm_query.weight", ".norm_conv.weight")) \
        and not name.endswith("linear_attn.norm.weight")


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


def expert_shapes(c: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    h, e = c.hidden_size, c.experts
    out = {p + "gate.weight": (e.count, h), p + "shared_expert_gate.weight": (1, h),
           p + "shared_expert.gate_proj.weight": (e.shared_intermediate, h),
           p + "shared_expert.up_proj.weight": (e.shared_intermediate, h),
           p + "shared_expert.down_proj.weight": (h, e.shared_intermediate)}
    for k in range(e.count):
        out.update({p + f"experts.{k}.gate_proj.weight": (e.intermediate, h),
                    p + f"experts.{k}.up_proj.weight": (e.intermediate, h),
                    p + f"experts.{k}.down_proj.weight": (h, e.intermediate)})
    return out


def indexer_shapes(c: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    x = c.indexer
    return {p + "index_qk_proj.weight": ((x.heads + 1) * x.head_dim, c.hidden_size),
            p + "q_layernorm.weight": (x.head_dim,), p + "k_layernorm.weight": (x.head_dim,)}


def ngram_shapes(c: ModelConfig, p: str, shards: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """A PLE layer's tensors under p, with its table's shards as the file holds them (`shards`:
    every shape the file has; the shards' count is the file's)."""
    g, wide = c.ngram, c.hc_count * c.hidden_size
    e = p + "ple_embedding."
    out = {p + "key_proj.weight": (wide, g.embed_dim), p + "value_proj.weight": (c.hidden_size, g.embed_dim),
           p + "norm_key.weight": (wide,), p + "norm_query.weight": (wide,), p + "norm_conv.weight": (wide,),
           p + "conv1d.weight": (wide, g.conv_kernel), e + "layer_multipliers": (g.ngram,),
           e + "ngram_heads_offsets": (g.heads,), e + "ngram_heads_vocab_sizes": (g.heads,)}
    out.update({name: shape for name, shape in shards.items() if name.startswith(e + "ngram_embedding.shard_")})
    return out


def trunk_shapes(c: ModelConfig, shards: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    out = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
           **hyper_shapes(c, "model.hyper_connection_mixer.", inject=False)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for n in range(c.num_layers):
        p = f"model.layers.{n}."
        out.update(hyper_shapes(c, p + "attn_hyper_connection."))
        out.update(hyper_shapes(c, p + "mlp_hyper_connection."))
        out.update(expert_shapes(c, p + "mlp."))
        if c.is_recurrent(n):
            block = qwen3_5_layout.block_shapes(c, p, True)
            out.update({k: v for k, v in block.items() if ".linear_attn." in k})
        else:
            out.update(qwen3_5_layout.attention_shapes(c, p))
            if c.indexer is not None:
                out.update(indexer_shapes(c, p + "self_attn.indexer."))
        if c.ngram is not None and n in c.ngram.layers:
            out.update(ngram_shapes(c, p + "ple.", shards))
    return out
