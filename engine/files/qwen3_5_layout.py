"""Where a Qwen3.5 model's tensors lie in its files, and what tandem reads them as.

tandem names every tensor as transformers does (`model.layers.N.linear_attn.in_proj_qkv.weight`,
`mtp.fc.weight`), with three values in the form the model computes with, which is also the form
llama.cpp's converter writes into GGUF:
- every (1 + w) RMSNorm holds 1 + w (the gated norm of a linear-attention layer scales by w itself);
- a linear-attention layer's `A` is -exp(A_log), the decay rate's factor;
- its depthwise convolution is [channels, kernel].
An HF checkpoint is read into that form here (`adapt_hf`); a GGUF file already holds it, under
llama.cpp's names (`gguf_name`). A multimodal checkpoint's text model sits under
`model.language_model.`; its MTP layer, under `mtp.`, in either.
"""
from __future__ import annotations

import torch

from engine.files.model_config import ModelConfig

TEXT_PREFIX = "model.language_model."
_GGUF_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
    "attn_gate.weight": "linear_attn.in_proj_z.weight",
    "ssm_beta.weight": "linear_attn.in_proj_b.weight",
    "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_a": "linear_attn.A",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# The MTP layer's own tensors (GGUF's blk.N.nextn.*, N the first layer after the trunk).
_GGUF_NEXTN = {"nextn.eh_proj.weight": "mtp.fc.weight", "nextn.enorm.weight": "mtp.pre_fc_norm_embedding.weight",
               "nextn.hnorm.weight": "mtp.pre_fc_norm_hidden.weight", "nextn.shared_head_norm.weight": "mtp.norm.weight",
               "nextn.shared_head_head.weight": "mtp.shared_head.weight",
               "nextn.embed_tokens.weight": "mtp.embed_tokens.weight"}
# MTP tensors a file may leave out: the model's lm_head and embedding then serve.
MTP_OPTIONAL = ("mtp.shared_head.weight", "mtp.embed_tokens.weight")


def gguf_name(name: str, trunk: int) -> str | None:
    """tandem's name of a qwen35 GGUF tensor, None for one it does not read."""
    if name in _GGUF_GLOBAL:
        return _GGUF_GLOBAL[name]
    parts = name.split(".", 2)
    if parts[0] != "blk" or len(parts) != 3 or not parts[1].isdecimal():
        return None
    layer, rest = int(parts[1]), parts[2]
    if layer < trunk:
        return f"model.layers.{layer}.{GGUF_LAYER[rest]}" if rest in GGUF_LAYER else None
    if rest in _GGUF_NEXTN:
        return _GGUF_NEXTN[rest]
    return f"mtp.layers.{layer - trunk}.{GGUF_LAYER[rest]}" if rest in GGUF_LAYER else None


def hf_name(name: str) -> str:
    """tandem's name of an HF checkpoint's tensor: the text model's prefix and A_log's name changed."""
    if name.startswith(TEXT_PREFIX):
        name = "model." + name[len(TEXT_PREFIX):]
    return name[:-len("A_log")] + "A" if name.endswith(".linear_attn.A_log") else name


def hf_shape(name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A tensor's shape as tandem reads it (the convolution without its middle axis)."""
    return (shape[0], shape[2]) if name.endswith("linear_attn.conv1d.weight") and len(shape) == 3 else shape


def _offset_norm(name: str) -> bool:
    """Whether the HF checkpoint stores this norm as w in (1 + w)."""
    return name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight") or \
        name.endswith(("pre_fc_norm_embedding.weight", "pre_fc_norm_hidden.weight"))


def adapt_hf(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """An HF checkpoint's tensor (under tandem's name) in the form tandem computes with, f32."""
    tensor = tensor.float()
    if _offset_norm(name):
        return 1.0 + tensor
    if name.endswith(".linear_attn.A"):
        return -tensor.exp()  # stored as A_log
    if name.endswith("linear_attn.conv1d.weight") and tensor.dim() == 3:
        return tensor[:, 0]
    return tensor


def attention_shapes(c: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """A gated-attention layer's tensors under prefix p (its q_proj holds each head's query then gate)."""
    h, q, kv, d = c.hidden_size, c.q_size, c.kv_size, c.head_dim
    return {p + "self_attn.q_proj.weight": (2 * q, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
            p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}


def block_shapes(c: ModelConfig, p: str, recurrent: bool) -> dict[str, tuple[int, ...]]:
    """A decoder layer's tensors under prefix p: its mixer's, its MLP's and its two norms."""
    h, i = c.hidden_size, c.intermediate_size
    out = {p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
           p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h), p + "mlp.down_proj.weight": (h, i)}
    if not recurrent:
        return {**out, **attention_shapes(c, p)}
    lin, a = c.linear, p + "linear_attn."
    return {**out, a + "in_proj_qkv.weight": (lin.conv_dim, h), a + "in_proj_z.weight": (lin.value_dim, h),
            a + "in_proj_b.weight": (lin.num_v_heads, h), a + "in_proj_a.weight": (lin.num_v_heads, h),
            a + "conv1d.weight": (lin.conv_dim, lin.conv_kernel), a + "A": (lin.num_v_heads,),
            a + "dt_bias": (lin.num_v_heads,), a + "norm.weight": (lin.v_head_dim,),
            a + "out_proj.weight": (h, lin.value_dim)}


def trunk_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    out = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size), "model.norm.weight": (c.hidden_size,)}
    if not c.tie_word_embeddings:
        out["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for n in range(c.num_layers):
        out.update(block_shapes(c, f"model.layers.{n}.", c.is_recurrent(n)))
    return out


def mtp_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The model's own MTP layers: per layer a full-attention decoder block, and the projection of
    [enorm(embedding); hnorm(hidden)] and the head's norm they share."""
    h = c.hidden_size
    out = {"mtp.fc.weight": (h, 2 * h), "mtp.pre_fc_norm_embedding.weight": (h,),
           "mtp.pre_fc_norm_hidden.weight": (h,), "mtp.norm.weight": (h,)}
    for k in range(c.num_nextn_predict_layers):
        out.update(block_shapes(c, f"mtp.layers.{k}.", False))
    return out


def optional_mtp_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    return dict.fromkeys(MTP_OPTIONAL, (c.vocab_size, c.hidden_size))

