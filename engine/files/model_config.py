"""ModelConfig: a decoder-only model's geometry, parsed from HF config.json or GGUF metadata
(engine/files/config_readers.py).

Everything here is validated when the config is built, before any tensor data is read; code
that receives a ModelConfig trusts it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from engine.errors import ConfigError
from engine.settings import CompressRatios

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_5", "qwen4_exp")
ROPE_KINDS = ("default", "linear", "llama3", "yarn")
# A layer's token mixer, as transformers' `layer_types` names it: softmax attention over a KV
# cache, or a Gated DeltaNet (linear attention, a recurrent state per slot).
FULL_ATTENTION, LINEAR_ATTENTION = "full_attention", "linear_attention"


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"
    factor: float = 1.0
    # llama3 and yarn: the context the model was pretrained with.
    original_max_positions: int = 0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # A GGUF file's `rope_freqs.weight`: each frequency divided by its factor, on top of `kind`.
    # llama.cpp's converter writes Llama 3's scaling this way, with no rope.scaling keys.
    freq_factors: tuple[float, ...] = ()


@dataclass(frozen=True)
class LinearAttention:
    """The geometry of a model's Gated DeltaNet layers (docs/architecture.md, "Gated DeltaNet").
    Each value head j reads key head j // (num_v_heads / num_k_heads), as transformers groups
    them, or j % num_k_heads where the file tiles them (llama.cpp's GGUF order, `tiled_v_heads`)."""
    conv_kernel: int
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    tiled_v_heads: bool = False

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: q, k and v."""
        return 2 * self.key_dim + self.value_dim

    @property
    def state_values(self) -> int:
        """f32 values of one slot's state in one layer: the recurrent state [v_heads, k_dim, v_dim]
        and the convolution's tail, the last conv_kernel - 1 inputs of every channel."""
        return self.num_v_heads * self.k_head_dim * self.v_head_dim + self.conv_dim * (self.conv_kernel - 1)

    def num_parameters(self, hidden: int) -> int:
        """in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, out_proj, the convolution, A, dt_bias and the
        gated norm."""
        return hidden * (self.conv_dim + self.value_dim + 2 * self.num_v_heads) + self.value_dim * hidden \
            + self.conv_dim * self.conv_kernel + 2 * self.num_v_heads + self.v_head_dim


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts MLP (Qwen4-Exp): a router picks `top_k` of `count` experts per token
    (softmax, then the top k, renormalised when norm_top_k), and a shared expert, scaled by a
    sigmoid gate, adds to every token (docs/architecture.md, "Qwen4-Exp")."""
    count: int
    top_k: int
    intermediate: int
    shared_intermediate: int
    norm_top_k: bool = True

    def num_parameters(self, hidden: int) -> int:
        return 3 * hidden * (self.count * self.intermediate + self.shared_intermediate) + hidden * (self.count + 1)


@dataclass(frozen=True)
class Indexer:
    """Qwen4-Exp's QSA indexer: `heads` query heads and one key head of `head_dim`, scoring blocks
    of `ratio` positions; a query keeps the `budget // ratio` best complete blocks and its tail."""
    heads: int
    head_dim: int
    budget: int
    ratio: int


@dataclass(frozen=True)
class NgramEmbedding:
    """Qwen4-Exp's per-layer n-gram embeddings (PLE) on the linear-attention `layers` (0-based):
    2..`ngram`-grams of the token ids hashed into `heads_per_ngram` tables each, `embed_dim` wide in
    all, and a depthwise convolution of `conv_kernel` taps dilated by `ngram`."""
    layers: tuple[int, ...]
    embed_dim: int
    conv_kernel: int
    ngram: int
    heads_per_ngram: int
    eos: int = -1  # the token that cuts n-grams (the model's end of sequence)
    # The hash constants where a GGUF file's metadata holds them (an HF checkpoint's are tensors).
    multipliers: tuple[int, ...] = ()
    offsets: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()

    @property
    def heads(self) -> int:
        return (self.ngram - 1) * self.heads_per_ngram

    @property
    def conv_tail(self) -> int:
        """Past positions the dilated convolution reads."""
        return (self.conv_kernel - 1) * self.ngram


@dataclass(frozen=True)
class ModelConfig:
    family: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # q/k/v projections carry a bias (Qwen2)
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3, Qwen3.5)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Each trunk layer's mixer (FULL_ATTENTION or LINEAR_ATTENTION); empty: all full attention.
    layer_types: tuple[str, ...] = ()
    linear: LinearAttention | None = None  # the linear-attention layers' geometry, when there are any
    # RoPE turns the first head_dim * partial_rotary_factor dims of each q and k head (Qwen3.5: 0.25).
    partial_rotary_factor: float = 1.0
    # q_proj gives each head its query and an output gate; attention's output is scaled by
    # sigmoid(gate) before o_proj (Qwen3.5).
    attn_output_gate: bool = False
    # tandem's own keys: one compress ratio per layer (trunk, then MTP layers); 0 is dense.
    compress_ratios: tuple[int, ...] = ()
    qsa_budget: int = 0
    # MTP layers the model carries beside its trunk (Qwen3.5's `mtp_num_hidden_layers`, GGUF's
    # nextn_predict_layers); 0 for a model without.
    num_nextn_predict_layers: int = 0
    # Qwen4-Exp: experts in place of the MLP; `hc_count` residual streams mixed by hyper-connections
    # (rank `hc_lowrank`) in place of the layers' norms; the QSA indexer of its attention layers;
    # n-gram embeddings; and the gated norm's activation in its linear-attention layers.
    experts: Experts | None = None
    hc_count: int = 0
    hc_lowrank: int = 0
    indexer: Indexer | None = None
    ngram: NgramEmbedding | None = None
    linear_gate_act: str = "silu"

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def residual_width(self) -> int:
        """Values per token between layers: hidden_size, or hc_count streams of it."""
        return self.hidden_size * max(self.hc_count, 1)

    @property
    def rotary_dim(self) -> int:
        """Dims of each q and k head that RoPE turns (the first ones; all without partial RoPE)."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def kinds(self) -> tuple[str, ...]:
        """Each trunk layer's mixer."""
        return self.layer_types or (FULL_ATTENTION,) * self.num_layers

    def is_recurrent(self, layer: int) -> bool:
        return self.kinds[layer] == LINEAR_ATTENTION

    @property
    def recurrent_layers(self) -> int:
        return sum(map(self.is_recurrent, range(self.num_layers)))

    @property
    def layer_ratios(self) -> tuple[int, ...]:
        """Compress ratio of each trunk layer (all 0, dense, when the config names none)."""
        return self.compress_ratios[: self.num_layers] or (0,) * self.num_layers

    def layer_parameters(self, layer: int) -> int:
        """One trunk layer's weights (its mixer, its MLP and its norms); an MTP layer's block is an
        attention layer's."""
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        mlp = self.experts.num_parameters(h) if self.experts else 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        # Two norms, or the hyper-connections of the mixer and of the MLP.
        wide = self.hc_count * h
        around = 2 * (wide + 2 * wide * self.hc_lowrank + wide * self.hc_count) if self.hc_count else 2 * h
        if layer < self.num_layers and self.is_recurrent(layer):
            return self.linear.num_parameters(h) + mlp + around + self._ngram_parameters(layer)
        q_out = 2 * q if self.attn_output_gate else q
        attn = h * q_out + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        x = self.indexer
        index = h * (x.heads + 1) * x.head_dim + 2 * x.head_dim if x else 0
        return attn + mlp + around + (2 * self.head_dim if self.qk_norm else 0) + index

    def _ngram_parameters(self, layer: int) -> int:
        """A PLE layer's projections, norms and convolution (its hashed tables are counted apart:
        memory-mapped, read by row)."""
        g = self.ngram
        if g is None or layer not in g.layers:
            return 0
        wide = self.hc_count * self.hidden_size
        return g.embed_dim * (wide + self.hidden_size) + 3 * wide + wide * g.conv_kernel

    def num_parameters(self) -> int:
        """The trunk's, with the embedding, lm_head and final norm (not the MTP layers)."""
        embed = self.vocab_size * self.hidden_size * (1 if self.tie_word_embeddings else 2)
        wide = self.hc_count * self.hidden_size
        final = wide + 2 * wide * self.hc_lowrank if self.hc_count else self.hidden_size
        return sum(map(self.layer_parameters, range(self.num_layers))) + embed + final

def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _validate(c: ModelConfig) -> None:
    _check(c.family in FAMILIES, f"architecture={c.family!r}: unknown architecture (supported: {', '.join(FAMILIES)})")
    for name in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "vocab_size"):
        value = getattr(c, name)
        _check(isinstance(value, int) and value > 0, f"{name}={value!r}: must be a positive integer")
    _check(c.num_heads % c.num_kv_heads == 0,
           f"num_key_value_heads={c.num_kv_heads}: must divide num_attention_heads={c.num_heads}")
    _check(c.head_dim % 2 == 0, f"head_dim={c.head_dim}: must be even for RoPE")
    _check(c.rms_norm_eps > 0, f"rms_norm_eps={c.rms_norm_eps}: must be > 0")
    r = c.rope
    _check(r.kind in ROPE_KINDS, f"rope_scaling.rope_type={r.kind!r}: unsupported RoPE scaling (supported: {', '.join(ROPE_KINDS)})")
    _check(r.theta > 0, f"rope_theta={r.theta}: must be > 0")
    if r.kind != "default":
        _check(r.factor > 0, f"rope_scaling.factor={r.factor}: must be > 0")
    if r.kind in ("llama3", "yarn"):
        _check(r.original_max_positions > 0,
               f"rope_scaling.original_max_position_embeddings={r.original_max_positions}: must be > 0 for {r.kind}")
    if r.kind == "llama3":
        _check(r.high_freq_factor > r.low_freq_factor,
               f"rope_scaling.high_freq_factor={r.high_freq_factor}: must exceed low_freq_factor={r.low_freq_factor}")
    _check(0 < c.partial_rotary_factor <= 1 and c.rotary_dim % 2 == 0 and c.rotary_dim > 0,
           f"partial_rotary_factor={c.partial_rotary_factor}: must turn an even number of each head's {c.head_dim} "
           f"dims, at least 2 (gives {c.rotary_dim})")
    if r.freq_factors:
        _check(len(r.freq_factors) == c.rotary_dim // 2 and all(f > 0 for f in r.freq_factors),
               f"rope_freqs.weight: must hold {c.rotary_dim // 2} positive factors (one per rotated pair of "
               f"{c.rotary_dim} dims), found {len(r.freq_factors)} (least {min(r.freq_factors):g})")
    _validate_layer_types(c)
    _validate_compression(c)
    _validate_qwen4_exp(c)


def _validate_layer_types(c: ModelConfig) -> None:
    if not c.layer_types:
        return
    _check(len(c.layer_types) == c.num_layers,
           f"layer_types has {len(c.layer_types)} entries: needs one per trunk layer ({c.num_layers})")
    for i, kind in enumerate(c.layer_types):
        _check(kind in (FULL_ATTENTION, LINEAR_ATTENTION),
               f"layer_types[{i}]={kind!r}: must be {FULL_ATTENTION} or {LINEAR_ATTENTION}")
    if LINEAR_ATTENTION not in c.layer_types:
        return
    lin = c.linear
    _check(lin is not None, f"layer_types: {LINEAR_ATTENTION} layers need the linear_* geometry "
                            "(linear_num_key_heads, linear_num_value_heads, linear_key_head_dim, ...)")
    for name in ("conv_kernel", "num_k_heads", "num_v_heads", "k_head_dim", "v_head_dim"):
        value = getattr(lin, name)
        _check(isinstance(value, int) and value > 0, f"linear {name}={value!r}: must be a positive integer")
    _check(lin.num_v_heads % lin.num_k_heads == 0,
           f"linear_num_key_heads={lin.num_k_heads}: must divide linear_num_value_heads={lin.num_v_heads}")
    _check(lin.conv_kernel >= 2, f"linear_conv_kernel_dim={lin.conv_kernel}: must be >= 2")


def _validate_qwen4_exp(c: ModelConfig) -> None:
    if c.family != "qwen4_exp":
        return
    _check(c.hc_count > 1, f"hc_count={c.hc_count}: Qwen4-Exp needs more than one residual stream")
    _check(c.hc_lowrank > 0, f"hc_lowrank={c.hc_lowrank}: must be > 0")
    _check(c.linear_gate_act in ("silu", "sigmoid"), f"output_gate_type={c.linear_gate_act!r}: must be silu or sigmoid")
    e = c.experts
    _check(e is not None and e.count > 0, "num_experts: Qwen4-Exp needs a positive number of experts")
    _check(0 < e.top_k <= e.count, f"num_experts_per_tok={e.top_k}: must be in [1, num_experts={e.count}]")
    _check(e.intermediate > 0 and e.shared_intermediate > 0,
           f"moe_intermediate_size={e.intermediate}, shared_expert_intermediate_size={e.shared_intermediate}: must be > 0")
    x = c.indexer
    if x is not None:
        for name in ("heads", "head_dim", "budget", "ratio"):
            _check(getattr(x, name) > 0, f"indexer {name}={getattr(x, name)}: must be > 0")
        _check(c.rotary_dim <= x.head_dim,
               f"indexer_head_dim={x.head_dim}: must hold the attention's {c.rotary_dim} rotary dims")
    g = c.ngram
    if g is not None:
        _check(g.ngram >= 2 and g.heads_per_ngram > 0 and g.embed_dim % g.heads == 0,
               f"ple_embed_dim={g.embed_dim}: must be a multiple of the {g.heads} n-gram heads "
               f"((ngram_size - 1) * heads_per_ngram, ngram_size >= 2)")
        for layer in g.layers:
            _check(0 <= layer < c.num_layers and c.is_recurrent(layer),
                   f"ple_layer_ids: layer {layer + 1} must be a linear_attention layer in [1, {c.num_layers}]")
        _check(g.eos >= 0, "eos_token_id: must be set when Qwen4-Exp has PLE layers")


def _validate_compression(c: ModelConfig) -> None:
    n = c.num_layers + c.num_nextn_predict_layers
    _check(c.num_nextn_predict_layers >= 0, f"num_nextn_predict_layers={c.num_nextn_predict_layers}: must be >= 0")
    if not c.compress_ratios:
        return
    _check(len(c.compress_ratios) == n,
           f"compress_ratios has {len(c.compress_ratios)} entries: needs one per layer ({c.num_layers} trunk + "
           f"{c.num_nextn_predict_layers} MTP = {n})")
    first_qsa = None
    for i, ratio in enumerate(c.compress_ratios):
        _check(ratio == 0 or ratio >= 2, f"compress_ratios[{i}]={ratio}: must be 0 (dense) or >= 2 (QSA)")
        _check(ratio == 0 or i >= c.num_layers or not c.is_recurrent(i),
               f"compress_ratios[{i}]={ratio}: layer {i} is a {LINEAR_ATTENTION} (recurrent) layer; only attention "
               "layers take a compress ratio")
        if ratio and first_qsa is None:
            first_qsa = i
        elif ratio:
            _check(ratio == c.compress_ratios[first_qsa],
                   f"compress_ratios[{i}]={ratio}: QSA layers must share one compress ratio "
                   f"(layer {first_qsa} has {c.compress_ratios[first_qsa]})")
    if first_qsa is not None:
        ratio = c.compress_ratios[first_qsa]
        _check(c.qsa_budget > 0 and c.qsa_budget % ratio == 0,
               f"qsa_budget={c.qsa_budget}: must be a positive multiple of the compress ratio {ratio}")


def with_compression(c: ModelConfig, override: CompressRatios | None, budget: int | None,
                     draft_ratios: tuple[int, ...] = ()) -> tuple[ModelConfig, tuple[int, ...]]:
    """The target's config with --compress-ratios and --qsa-budget applied, and the detached draft's
    layer ratios (its file's, unless the list form gives them after the trunk's). The trunk and the
    draft are checked together: they share one ratio and the budget. A model with its own QSA
    indexer (Qwen4-Exp) takes neither flag, its ratio and budget being what it was trained with, but
    `--compress-ratios none`: dense attention on every layer, its indexer unused (the dense twin that
    QSA's speed and quality are measured against)."""
    n = c.num_layers
    dense = override is not None and not any(override.expand(n))
    if c.indexer is not None and (budget is not None or (override is not None and not dense)):
        flag = "compress_ratios" if override is not None else "qsa_budget"
        raise ConfigError(f"{flag}: this model's QSA is its indexer's (indexer_compress_ratio={c.indexer.ratio}, "
                          f"indexer_budget={c.indexer.budget}); the flag applies to models without one "
                          f"(compress_ratios none makes every layer dense)")
    trunk = c.layer_ratios
    if override is not None:
        given = override.expand(n)
        if len(given) == n:
            trunk = given
        elif draft_ratios and len(given) == n + len(draft_ratios):
            trunk, draft_ratios = given[:n], given[n:]
        else:
            whole = f" or one per trunk and draft layer ({n} + {len(draft_ratios)})" if draft_ratios else ""
            raise ConfigError(f"compress_ratios has {len(given)} entries: needs one per trunk layer ({n}){whole}")
    built_in = c.compress_ratios[n:] or (0,) * c.num_nextn_predict_layers
    target = replace(c, compress_ratios=trunk + built_in, qsa_budget=c.qsa_budget if budget is None else budget)
    if draft_ratios:  # the trunk's and the draft's ratios together, under ModelConfig's rules
        _validate_compression(replace(target, compress_ratios=trunk + draft_ratios,
                                      num_nextn_predict_layers=len(draft_ratios)))
    return target, draft_ratios


def cache_bytes_per_position(config: ModelConfig, bytes_per_value: float) -> dict[str, tuple[int, float, float]]:
    """Per layer kind ("dense", "qsa r=4"): (layers of that kind, K+V bytes one position costs in
    one such layer, pooled-key bytes per position: an f32 key per `ratio` positions)."""
    out: dict[str, tuple[int, float, float]] = {}
    for layer, ratio in enumerate(config.layer_ratios):
        if config.is_recurrent(layer):  # a state per slot, not per position: recurrent_state_bytes
            continue
        kind = f"qsa r={ratio}" if ratio else "dense"
        layers = out.get(kind, (0, 0.0, 0.0))[0] + 1
        pool = config.kv_size * 4 / ratio if ratio else 0.0
        if ratio and config.indexer is not None:  # the indexer's raw key, and a block key per ratio positions
            pool = config.indexer.head_dim * 4 * (1 + 1 / ratio)
        out[kind] = (layers, 2 * config.kv_size * bytes_per_value, pool)
    return out


def recurrent_state_bytes(config: ModelConfig) -> int:
    """One slot's state in every linear-attention layer: f32 recurrent state and convolution tail
    (one position's; engine/model/recurrent_cache.py keeps a few positions' per slot)."""
    if config.linear is None:
        return 0
    g, ngram = config.ngram, 0
    if g is not None:  # each n-gram layer's last n-1 token ids and its convolution's inputs
        ngram = len(g.layers) * (8 * (g.ngram - 1) + 4 * g.conv_tail * config.hc_count * config.hidden_size)
    return 4 * config.linear.state_values * config.recurrent_layers + ngram


def describe_rope(rope: RopeConfig) -> str:
    factors = " with the file's frequency factors" if rope.freq_factors else ""
    if rope.kind == "default":
        return f"theta={rope.theta:g}{factors}"
    return f"theta={rope.theta:g} {rope.kind} x{rope.factor:g}{factors}"


def num_param_bytes(config: ModelConfig, bytes_per_weight: float) -> int:
    return math.ceil(config.num_parameters() * bytes_per_weight)
