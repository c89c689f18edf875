"""ModelConfig: a decoder-only model's geometry, parsed from HF config.json or GGUF metadata.

Everything here is validated when the config is built, before any tensor data is read; code
that receives a ModelConfig trusts it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from engine.errors import ConfigError
from engine.settings import CompressRatios

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
ROPE_KINDS = ("default", "linear", "llama3", "yarn")


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
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # tandem's own keys: one compress ratio per layer (trunk, then MTP layers); 0 is dense.
    compress_ratios: tuple[int, ...] = ()
    qsa_budget: int = 0
    num_nextn_predict_layers: int = 0

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_ratios(self) -> tuple[int, ...]:
        """Compress ratio of each trunk layer (all 0, dense, when the config names none)."""
        return self.compress_ratios[: self.num_layers] or (0,) * self.num_layers

    def num_parameters(self) -> int:
        h, i, q, kv = self.hidden_size, self.intermediate_size, self.q_size, self.kv_size
        attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if self.attention_bias else 0)
        mlp = 3 * h * i + ((2 * i + h) if self.mlp_bias else 0)
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + norms) + embed + h


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
    _validate_compression(c)


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
    draft are checked together: they share one ratio and the budget."""
    n = c.num_layers
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


def _get(d: dict, key: str, default=None):
    value = d.get(key)
    return default if value is None else value


def _rope_from_hf(d: dict) -> RopeConfig:
    # transformers 5 writes rope_parameters; older configs write rope_theta plus rope_scaling.
    params = dict(_get(d, "rope_parameters", {}) or {})
    scaling = dict(_get(d, "rope_scaling", {}) or {})
    params = {**scaling, **params}
    theta = float(_get(params, "rope_theta", _get(d, "rope_theta", 10000.0)))
    kind = _get(params, "rope_type", _get(params, "type", "default"))
    source = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    _check(kind in ROPE_KINDS, f"{source}.rope_type={kind!r}: unsupported RoPE scaling (supported: {', '.join(ROPE_KINDS)})")
    if "partial_rotary_factor" in params or "partial_rotary_factor" in d:
        factor = _get(params, "partial_rotary_factor", _get(d, "partial_rotary_factor", 1.0))
        _check(factor == 1.0, f"partial_rotary_factor={factor}: partial RoPE is not supported")
    original = int(_get(params, "original_max_position_embeddings", _get(d, "max_position_embeddings", 2048)))
    return RopeConfig(
        theta=theta, kind=kind, factor=float(_get(params, "factor", 1.0)), original_max_positions=original,
        low_freq_factor=float(_get(params, "low_freq_factor", 1.0)),
        high_freq_factor=float(_get(params, "high_freq_factor", 4.0)),
        beta_fast=float(_get(params, "beta_fast", 32.0)), beta_slow=float(_get(params, "beta_slow", 1.0)),
        attention_factor=params.get("attention_factor"), mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"), truncate=bool(_get(params, "truncate", True)),
    )


def _reject_sliding_window(d: dict) -> None:
    window = d.get("sliding_window")
    uses_window = d.get("use_sliding_window", window is not None)
    if d.get("layer_types"):
        kinds = set(d["layer_types"])
        _check(kinds <= {"full_attention"}, f"layer_types={sorted(kinds)}: only full_attention layers are supported")
    _check(not (uses_window and window is not None),
           f"sliding_window={window}: sliding-window attention is not supported (set it to null)")


def from_hf_dict(d: dict) -> ModelConfig:
    """Build a ModelConfig from the dict of an HF config.json."""
    family = d.get("model_type", d.get("architectures", ["?"])[0] if d.get("architectures") else "?")
    _check(family in FAMILIES, f"model_type={family!r}: unknown architecture (supported: {', '.join(FAMILIES)})")
    _reject_sliding_window(d)
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size", "intermediate_size"):
        _check(key in d, f"{key}: missing from config.json")
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    head_dim = d.get("head_dim")
    if head_dim is None:
        _check(hidden % heads == 0,
               f"hidden_size={hidden}: must be divisible by num_attention_heads={heads} when head_dim is absent")
        head_dim = hidden // heads
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    return ModelConfig(
        family=family, hidden_size=hidden, intermediate_size=d["intermediate_size"],
        num_layers=d["num_hidden_layers"], num_heads=heads,
        num_kv_heads=_get(d, "num_key_value_heads", heads), head_dim=head_dim, vocab_size=d["vocab_size"],
        rms_norm_eps=float(_get(d, "rms_norm_eps", 1e-6)), rope=_rope_from_hf(d),
        max_position_embeddings=int(_get(d, "max_position_embeddings", 2048)),
        tie_word_embeddings=bool(_get(d, "tie_word_embeddings", False)),
        # transformers fixes q/k/v biases for Qwen2 (always) and Mistral (never), whatever the key says.
        attention_bias=family == "qwen2" or (family in ("llama", "qwen3") and bool(_get(d, "attention_bias", False))),
        mlp_bias=bool(_get(d, "mlp_bias", False)), qk_norm=family == "qwen3",
        bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids,
        compress_ratios=tuple(d.get("compress_ratios") or ()), qsa_budget=int(_get(d, "qsa_budget", 0)),
        num_nextn_predict_layers=int(_get(d, "num_nextn_predict_layers", 0)),
    )


def from_gguf_metadata(meta: dict, tensor_shapes: dict[str, tuple[int, ...]]) -> ModelConfig:
    """Build a ModelConfig from GGUF key/values (already decoded to Python values)."""
    arch = meta.get("general.architecture", "?")
    _check(arch in FAMILIES, f"general.architecture={arch!r}: unknown architecture (supported: {', '.join(FAMILIES)})")

    def key(name, default=None):
        return meta.get(f"{arch}.{name}", default)

    for name in ("embedding_length", "block_count", "attention.head_count", "feed_forward_length"):
        _check(key(name) is not None, f"{arch}.{name}: missing from GGUF metadata")
    hidden, heads = int(key("embedding_length")), int(key("attention.head_count"))
    head_dim = key("attention.key_length")
    if head_dim is None:
        _check(hidden % heads == 0,
               f"{arch}.embedding_length={hidden}: must be divisible by {arch}.attention.head_count={heads} "
               "when attention.key_length is absent")
        head_dim = hidden // heads
    window = key("attention.sliding_window")
    _check(not window, f"{arch}.attention.sliding_window={window}: sliding-window attention is not supported")
    vocab = key("vocab_size") or len(meta.get("tokenizer.ggml.tokens", ())) or tensor_shapes["token_embd.weight"][0]
    scaling = key("rope.scaling.type", "none")
    kind = {"none": "default", "linear": "linear", "yarn": "yarn", "llama3": "llama3"}.get(scaling, scaling)
    # llama.cpp stores llama3 scaling as precomputed per-frequency factors, which tandem does not read.
    _check("rope_freqs.weight" not in tensor_shapes,
           "rope_freqs.weight: GGUF files with precomputed RoPE frequency factors are not supported")
    rope = RopeConfig(
        theta=float(key("rope.freq_base", 10000.0)), kind=kind, factor=float(key("rope.scaling.factor", 1.0)),
        original_max_positions=int(key("rope.scaling.original_context_length", key("context_length", 2048))),
    )
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id")
    return ModelConfig(
        family=arch, hidden_size=hidden, intermediate_size=int(key("feed_forward_length")),
        num_layers=int(key("block_count")), num_heads=heads,
        num_kv_heads=int(key("attention.head_count_kv", heads)), head_dim=int(head_dim), vocab_size=int(vocab),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)), rope=rope,
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_shapes,
        attention_bias="blk.0.attn_q.bias" in tensor_shapes, qk_norm="blk.0.attn_q_norm.weight" in tensor_shapes,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(t for t in (eos, eot) if t is not None)),
        compress_ratios=tuple(int(r) for r in key("attention.compress_ratios", ())),
        qsa_budget=int(key("attention.qsa_budget", 0)),
    )


def cache_bytes_per_position(config: ModelConfig, bytes_per_value: float) -> dict[str, tuple[int, float, float]]:
    """Per layer kind ("dense", "qsa r=4"): (layers of that kind, K+V bytes one position costs in
    one such layer, pooled-key bytes per position: an f32 key per `ratio` positions)."""
    out: dict[str, tuple[int, float, float]] = {}
    for ratio in config.layer_ratios:
        kind = f"qsa r={ratio}" if ratio else "dense"
        layers = out.get(kind, (0, 0.0, 0.0))[0] + 1
        out[kind] = (layers, 2 * config.kv_size * bytes_per_value, config.kv_size * 4 / ratio if ratio else 0.0)
    return out


def describe_rope(rope: RopeConfig) -> str:
    if rope.kind == "default":
        return f"theta={rope.theta:g}"
    return f"theta={rope.theta:g} {rope.kind} x{rope.factor:g}"


def num_param_bytes(config: ModelConfig, bytes_per_weight: float) -> int:
    return math.ceil(config.num_parameters() * bytes_per_weight)
