"""ModelConfig from what a model file says of itself: an HF config.json, or GGUF metadata as
llama.cpp's converter writes it. Every value is checked (ModelConfig validates) before any tensor
data is read."""
from __future__ import annotations

from engine.errors import ConfigError
from engine.files.model_config import (FAMILIES, FULL_ATTENTION, LINEAR_ATTENTION, ROPE_KINDS, Experts, Indexer,
                                       LinearAttention, ModelConfig, NgramEmbedding, RopeConfig)

# GGUF's architecture names, where they differ from transformers' model_type.
GGUF_ARCHS = {"qwen35": "qwen3_5", "qwen4exp": "qwen4_exp"}
# transformers' model_type of a text model inside a multimodal checkpoint's config.json.
TEXT_MODEL_TYPES = {"qwen3_5_text": "qwen3_5", "qwen4_exp_text": "qwen4_exp"}
# Families whose layers are of several kinds (layer_types), a recurrent state beside attention.
HYBRID = ("qwen3_5", "qwen4_exp")
# Qwen4-Exp names its attention layers indexed_attention (the real checkpoint: full_attention); all
# of them attend through the indexer when the config has one.
INDEXED_ATTENTION = "indexed_attention"


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _get(d: dict, key: str, default=None):
    value = d.get(key)
    return default if value is None else value


def _rope_from_hf(d: dict) -> tuple[RopeConfig, float]:
    """The RoPE settings and the partial rotary factor (1.0: every dim turns)."""
    # transformers 5 writes rope_parameters; older configs write rope_theta plus rope_scaling.
    params = dict(_get(d, "rope_parameters", {}) or {})
    scaling = dict(_get(d, "rope_scaling", {}) or {})
    params = {**scaling, **params}
    theta = float(_get(params, "rope_theta", _get(d, "rope_theta", 10000.0)))
    kind = _get(params, "rope_type", _get(params, "type", "default"))
    source = "rope_parameters" if d.get("rope_parameters") else "rope_scaling"
    _check(kind in ROPE_KINDS, f"{source}.rope_type={kind!r}: unsupported RoPE scaling (supported: {', '.join(ROPE_KINDS)})")
    partial = float(_get(params, "partial_rotary_factor", _get(d, "partial_rotary_factor", 1.0)))
    original = int(_get(params, "original_max_position_embeddings", _get(d, "max_position_embeddings", 2048)))
    return RopeConfig(
        theta=theta, kind=kind, factor=float(_get(params, "factor", 1.0)), original_max_positions=original,
        low_freq_factor=float(_get(params, "low_freq_factor", 1.0)),
        high_freq_factor=float(_get(params, "high_freq_factor", 4.0)),
        beta_fast=float(_get(params, "beta_fast", 32.0)), beta_slow=float(_get(params, "beta_slow", 1.0)),
        attention_factor=params.get("attention_factor"), mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"), truncate=bool(_get(params, "truncate", True)),
    ), partial


def _reject_sliding_window(d: dict, family: str) -> None:
    window = d.get("sliding_window")
    uses_window = d.get("use_sliding_window", window is not None)
    if d.get("layer_types") and family not in HYBRID:
        kinds = set(d["layer_types"])
        _check(kinds <= {FULL_ATTENTION}, f"layer_types={sorted(kinds)}: only full_attention layers are supported")
    _check(not (uses_window and window is not None),
           f"sliding_window={window}: sliding-window attention is not supported (set it to null)")


def _text_config(d: dict) -> dict:
    """A multimodal checkpoint's text model (Qwen3.5's `text_config`), with the outer config's keys
    it does not set itself (tie_word_embeddings lives on the outer one)."""
    text = d.get("text_config")
    if not isinstance(text, dict):
        return d
    merged = {**{k: v for k, v in d.items() if k != "text_config"}, **text}
    if "tie_word_embeddings" in d:
        merged["tie_word_embeddings"] = d["tie_word_embeddings"]
    return merged


def _linear_from_hf(d: dict, layers: int) -> tuple[tuple[str, ...], LinearAttention | None]:
    """Qwen3.5's layer kinds (layer_types, else every full_attention_interval-th layer attends) and
    its Gated DeltaNet geometry."""
    kinds = d.get("layer_types")
    if kinds is None:
        interval = int(_get(d, "full_attention_interval", 4))
        _check(interval >= 1, f"full_attention_interval={interval}: must be >= 1")
        kinds = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(layers)]
    kinds = [FULL_ATTENTION if kind == INDEXED_ATTENTION else kind for kind in kinds]
    linear = LinearAttention(
        conv_kernel=int(_get(d, "linear_conv_kernel_dim", 4)), num_k_heads=int(_get(d, "linear_num_key_heads", 16)),
        num_v_heads=int(_get(d, "linear_num_value_heads", 32)), k_head_dim=int(_get(d, "linear_key_head_dim", 128)),
        v_head_dim=int(_get(d, "linear_value_head_dim", 128)))
    return tuple(kinds), linear


def from_hf_dict(d: dict) -> ModelConfig:
    """Build a ModelConfig from the dict of an HF config.json."""
    d = _text_config(d)
    family = d.get("model_type", d.get("architectures", ["?"])[0] if d.get("architectures") else "?")
    family = TEXT_MODEL_TYPES.get(family, family)
    _check(family in FAMILIES, f"model_type={family!r}: unknown architecture (supported: {', '.join(FAMILIES)})")
    _reject_sliding_window(d, family)
    qwen4 = family == "qwen4_exp"
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size",
                "moe_intermediate_size" if qwen4 else "intermediate_size"):
        _check(key in d, f"{key}: missing from config.json")
    hidden, heads = d["hidden_size"], d["num_attention_heads"]
    head_dim = d.get("head_dim")
    if head_dim is None:
        _check(hidden % heads == 0,
               f"hidden_size={hidden}: must be divisible by num_attention_heads={heads} when head_dim is absent")
        head_dim = hidden // heads
    eos = d.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    rope, partial = _rope_from_hf(d)
    hybrid = family in HYBRID
    _check(partial == 1.0 or hybrid, f"partial_rotary_factor={partial}: partial RoPE is not supported for {family}")
    _check(not (hybrid and d.get("attention_bias")), f"attention_bias=True: not supported for {family}")
    kinds, linear = _linear_from_hf(d, d["num_hidden_layers"]) if hybrid else ((), None)
    qwen4_keys = _qwen4_exp_from_hf(d, kinds) if qwen4 else {}
    return ModelConfig(
        family=family, hidden_size=hidden, intermediate_size=d["moe_intermediate_size" if qwen4 else "intermediate_size"],
        num_layers=d["num_hidden_layers"], num_heads=heads,
        num_kv_heads=_get(d, "num_key_value_heads", heads), head_dim=head_dim, vocab_size=d["vocab_size"],
        rms_norm_eps=float(_get(d, "rms_norm_eps", 1e-6)), rope=rope,
        max_position_embeddings=int(_get(d, "max_position_embeddings", 2048)),
        tie_word_embeddings=bool(_get(d, "tie_word_embeddings", False)),
        # transformers fixes q/k/v biases for Qwen2 (always) and Mistral (never), whatever the key says.
        attention_bias=family == "qwen2" or (family in ("llama", "qwen3") and bool(_get(d, "attention_bias", False))),
        mlp_bias=bool(_get(d, "mlp_bias", False)), qk_norm=family in ("qwen3", *HYBRID),
        bos_token_id=d.get("bos_token_id"), eos_token_ids=eos_ids,
        layer_types=kinds, linear=linear, partial_rotary_factor=partial, attn_output_gate=hybrid,
        num_nextn_predict_layers=int(_get(d, "mtp_num_hidden_layers" if hybrid else "num_nextn_predict_layers", 0)),
        **{"compress_ratios": tuple(d.get("compress_ratios") or ()), "qsa_budget": int(_get(d, "qsa_budget", 0)),
           **qwen4_keys},
    )


def _qwen4_exp_from_hf(d: dict, kinds) -> dict:
    """Qwen4-Exp's experts, hyper-connections, indexer (its QSA: each attention layer a QSA layer
    of the indexer's ratio and budget) and n-gram embeddings, as ModelConfig keys."""
    out = dict(
        experts=Experts(count=int(_get(d, "num_experts", 512)), top_k=int(_get(d, "num_experts_per_tok", 10)),
                        intermediate=int(d["moe_intermediate_size"]),
                        shared_intermediate=int(_get(d, "shared_expert_intermediate_size", 512)),
                        norm_top_k=bool(_get(d, "norm_topk_prob", True))),
        hc_count=int(_get(d, "hc_count", 4)), hc_lowrank=int(_get(d, "hc_lowrank", 320)),
        linear_gate_act=_get(d, "output_gate_type", _get(d, "hidden_act", "silu")))
    fields = ("indexer_n_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
    given = [name for name in fields if d.get(name) is not None]
    if given:
        missing = [name for name in fields if name not in given]
        _check(not missing, f"{', '.join(missing)}: missing from config.json (the QSA indexer needs all of {', '.join(fields)})")
        _check(int(_get(d, "indexer_kv_heads", 1)) == 1, f"indexer_kv_heads={d.get('indexer_kv_heads')}: must be 1")
        x = Indexer(heads=int(d["indexer_n_heads"]), head_dim=int(d["indexer_head_dim"]),
                    budget=int(d["indexer_budget"]), ratio=int(d["indexer_compress_ratio"]))
        _check(x.ratio > 0 and x.budget % x.ratio == 0,
               f"indexer_budget={x.budget}: must be a multiple of indexer_compress_ratio={x.ratio}")
        out.update(indexer=x, qsa_budget=x.budget,
                   compress_ratios=tuple(0 if kind == LINEAR_ATTENTION else x.ratio for kind in kinds) +
                   (0,) * int(_get(d, "mtp_num_hidden_layers", 0)))
    layers = sorted(set(_get(d, "ple_layer_ids", [])))
    if layers:
        eos = d.get("eos_token_id")
        out["ngram"] = NgramEmbedding(layers=tuple(i - 1 for i in layers),
                                      eos=int((eos[0] if eos else -1) if isinstance(eos, list) else _get(d, "eos_token_id", -1)),
                                      embed_dim=int(_get(d, "ple_embed_dim", d["hidden_size"])),
                                      conv_kernel=int(_get(d, "ple_conv_kernel_size", 4)),
                                      ngram=int(_get(d, "ngram_size", 3)),
                                      heads_per_ngram=int(_get(d, "heads_per_ngram", 8)))
    return out


def _linear_from_gguf(key, trunk: int) -> tuple[tuple[str, ...], LinearAttention]:
    """qwen35's layer kinds (attention.recurrent_layers, else every full_attention_interval-th layer
    attends) and its Gated DeltaNet geometry from the ssm.* keys, as llama.cpp reads them. Its
    converter tiles the value heads (tiled_v_heads)."""
    for name in ("ssm.conv_kernel", "ssm.state_size", "ssm.group_count", "ssm.time_step_rank", "ssm.inner_size"):
        _check(key(name) is not None, f"{name}: missing from GGUF metadata")
    recurrent = key("attention.recurrent_layers")
    if recurrent is None:
        interval = int(key("full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(trunk)]
    kinds = tuple(LINEAR_ATTENTION if r else FULL_ATTENTION for r in list(recurrent)[:trunk])
    v_heads = int(key("ssm.time_step_rank"))
    inner = int(key("ssm.inner_size"))
    _check(inner % v_heads == 0, f"ssm.inner_size={inner}: must be a multiple of ssm.time_step_rank={v_heads}")
    return kinds, LinearAttention(conv_kernel=int(key("ssm.conv_kernel")), num_k_heads=int(key("ssm.group_count")),
                                  num_v_heads=v_heads, k_head_dim=int(key("ssm.state_size")),
                                  v_head_dim=inner // v_heads, tiled_v_heads=True)


def from_gguf_metadata(meta: dict, tensor_shapes: dict[str, tuple[int, ...]],
                       rope_freqs: tuple[float, ...] = ()) -> ModelConfig:
    """Build a ModelConfig from GGUF key/values (already decoded to Python values) and the values
    of the file's `rope_freqs.weight`, where it has one."""
    arch = meta.get("general.architecture", "?")
    family = GGUF_ARCHS.get(arch, arch)
    names = ", ".join(a for a in (*FAMILIES, *GGUF_ARCHS) if a not in GGUF_ARCHS.values())
    _check(family in FAMILIES, f"general.architecture={arch!r}: unknown architecture (supported: {names})")

    def key(name, default=None):
        return meta.get(f"{arch}.{name}", default)

    qwen4 = family == "qwen4_exp"
    ffn = "expert_feed_forward_length" if qwen4 else "feed_forward_length"
    for name in ("embedding_length", "block_count", "attention.head_count", ffn):
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
    rope = RopeConfig(
        theta=float(key("rope.freq_base", 10000.0)), kind=kind, factor=float(key("rope.scaling.factor", 1.0)),
        original_max_positions=int(key("rope.scaling.original_context_length", key("context_length", 2048))),
        freq_factors=rope_freqs,
    )
    eos = meta.get("tokenizer.ggml.eos_token_id")
    eot = meta.get("tokenizer.ggml.eot_token_id")
    nextn = int(key("nextn_predict_layers", 0))
    # block_count counts the MTP layers after the trunk's (llama.cpp's n_layer_all).
    trunk = int(key("block_count")) - nextn
    hybrid = family in HYBRID
    kinds, linear = _linear_from_gguf(key, trunk) if hybrid else ((), None)
    rotary = key("rope.dimension_count")
    kv_heads = key("attention.head_count_kv", heads)
    if isinstance(kv_heads, (list, tuple)):  # per layer, 0 for a recurrent one (hybrid files may write it so)
        kv_heads = max(kv_heads)
    qwen4_keys = _qwen4_exp_from_gguf(key, kinds, hidden, nextn) if qwen4 else {}
    return ModelConfig(
        family=family, hidden_size=hidden, intermediate_size=int(key(ffn)),
        num_layers=trunk, num_heads=heads,
        num_kv_heads=int(kv_heads), head_dim=int(head_dim), vocab_size=int(vocab),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-6)), rope=rope,
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensor_shapes,
        attention_bias="blk.0.attn_q.bias" in tensor_shapes,
        qk_norm=hybrid or "blk.0.attn_q_norm.weight" in tensor_shapes,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(t for t in (eos, eot) if t is not None)),
        layer_types=kinds, linear=linear, attn_output_gate=hybrid,
        partial_rotary_factor=int(rotary) / int(head_dim) if hybrid and rotary else 1.0,
        num_nextn_predict_layers=nextn,
        **{"compress_ratios": tuple(int(r) for r in key("attention.compress_ratios", ())),
           "qsa_budget": int(key("attention.qsa_budget", 0)), **qwen4_keys},
    )


def _qwen4_exp_from_gguf(key, kinds, hidden: int, nextn: int) -> dict:
    """qwen4exp's experts, hyper-connections, indexer and n-gram embeddings from its metadata, as
    llama.cpp's converter writes them (the indexer's ratio: its attention layers' compress ratio)."""
    for name in ("expert_count", "expert_used_count", "expert_shared_feed_forward_length",
                 "hyper_connection.count", "hyper_connection.low_rank"):
        _check(key(name) is not None, f"{name}: missing from GGUF metadata")
    out = dict(
        experts=Experts(count=int(key("expert_count")), top_k=int(key("expert_used_count")),
                        intermediate=int(key("expert_feed_forward_length")),
                        shared_intermediate=int(key("expert_shared_feed_forward_length")),
                        norm_top_k=bool(key("expert_weights_norm", True))),
        hc_count=int(key("hyper_connection.count")), hc_lowrank=int(key("hyper_connection.low_rank")),
        # The converter writes no output_gate_type: llama.cpp's qwen4exp gates the linear-attention
        # norm with a sigmoid, as the released checkpoint's config says.
        linear_gate_act="sigmoid")
    ratios = [int(r) for r in key("attention.compress_ratios", ())]
    if key("attention.indexer.head_count") is not None:
        ratio = max(ratios, default=0)
        _check(ratio > 0, "attention.compress_ratios: an indexer needs its attention layers' compress ratio")
        x = Indexer(heads=int(key("attention.indexer.head_count")), head_dim=int(key("attention.indexer.key_length")),
                    budget=int(key("attention.indexer.top_k")), ratio=ratio)
        _check(x.budget % x.ratio == 0,
               f"attention.indexer.top_k={x.budget}: must be a multiple of the compress ratio {x.ratio}")
        out.update(indexer=x, qsa_budget=x.budget,
                   compress_ratios=tuple(0 if kind == LINEAR_ATTENTION else ratio for kind in kinds) + (0,) * nextn)
    layers = tuple(int(i) for i in key("ple.layers", ()))
    if layers:
        _check(len(layers) == 1, f"ple.layers={list(layers)}: a GGUF file holds one n-gram table (one PLE layer)")
        ngram, heads = int(key("ple.ngram_size", 3)), int(key("ple.heads_per_ngram", 8))
        out["ngram"] = NgramEmbedding(
            layers=layers, embed_dim=(ngram - 1) * heads * int(key("embedding_length_per_layer_input")),
            conv_kernel=int(key("ple.conv_kernel", 4)), ngram=ngram, heads_per_ngram=heads,
            multipliers=tuple(int(v) for v in key("ple.layer_multipliers")),
            offsets=tuple(int(v) for v in key("ple.head_offsets")), sizes=tuple(int(v) for v in key("ple.head_vocab_sizes")),
            eos=int(key("ple.eos_token_id", -1)))
    return out
