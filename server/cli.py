"""The engine's config and the server's settings, built from the parsed command-line flags."""
from __future__ import annotations

from typing import Sequence

from engine import EngineConfig, SpecConfig
from engine.settings import PAGE_SIZE, SPEC_NONE, SPEC_TYPES
from server.flags import AUTO_PARALLEL, ServerFlags, parse_flags
from server.state import ServerSettings


def _spec(f: ServerFlags) -> SpecConfig | None:
    """--spec-type as given (none: off). Without it the default model, the product, speculates with
    draft-mtp-ngram and its shipped draft (or -md's file), in chains: on open chat it paid 1.34x
    and 1.40x plain f32 where draft-mtp paid 1.19x and 1.30x, and over the file's own Q4_1 blocks
    (the default format) a chain paid 1.19x plain where trees of 2 and 3 paid 1.14x and 1.10x
    (docs/benchmarks.md). Another model does not speculate unasked, and -md alone does not turn
    speculation on. An MTP type asked for on the default model drafts with its shipped draft
    unless -md names another."""
    if f.spec_type is None and f.model == "default":
        kind, draft = "draft-mtp-ngram", f.spec_draft_model or "default"
    elif f.spec_type is None or f.spec_type == SPEC_NONE:
        return None
    else:
        kind, draft = SPEC_TYPES[f.spec_type], f.spec_draft_model
        if draft is None and f.model == "default" and kind in ("draft-mtp", "draft-mtp-ngram"):
            draft = "default"
    return SpecConfig(type=kind, draft_model=draft, n_max=f.spec_draft_n_max, n_min=f.spec_draft_n_min,
                      p_min=f.spec_draft_p_min, ngram_n=f.spec_ngram_size_n, max_batch=f.spec_max_batch,
                      width=f.spec_draft_width, p_sibling=f.spec_draft_p_sibling, pacing=not f.no_spec_pacing)


def _slots(f: ServerFlags) -> tuple[int, bool, tuple[str, ...]]:
    """Slots and whether they share one pool: -np and --kv-unified as given, else AUTO_PARALLEL
    sharing one pool, yielding to the flags the user gave (and saying why)."""
    if f.parallel is not None:
        return f.parallel, f.kv_unified, ()
    if f.ctx_size < PAGE_SIZE and not f.kv_unified:
        return 1, False, (f"-np auto: 1 slot with the whole context, not {AUTO_PARALLEL} sharing one KV pool: a pool "
                          f"needs ctx_size >= {PAGE_SIZE}, got {f.ctx_size}",)
    if f.batch_size < AUTO_PARALLEL:
        return f.batch_size, True, (f"-np auto: {f.batch_size} slot(s), not {AUTO_PARALLEL}: batch_size="
                                    f"{f.batch_size} holds one row per slot",)
    return AUTO_PARALLEL, True, ()


def configs(f: ServerFlags) -> tuple[EngineConfig, ServerSettings]:
    """Raises ConfigError (naming the field) for a combination of flags the engine cannot run. Without
    -np, AUTO_PARALLEL slots share one unified KV pool (llama-server's -np auto): each request may
    still use the whole context; an explicit -np N splits it N ways unless --kv-unified is given."""
    spec = _spec(f)
    parallel, unified, adapted = _slots(f)
    engine = EngineConfig(model=f.model, dtype=f.dtype, activations=f.activations, ctx_size=f.ctx_size, parallel=parallel,
                          batch_size=f.batch_size, ubatch_size=f.ubatch_size, cache_type=f.cache_type_k,
                          cache_type_v=f.cache_type_v, kv_unified=unified,
                          auto_slots=f.parallel is None and not f.kv_unified, adapted=adapted,
                          threads=f.threads or (len(f.cpus) if f.cpus else None), chat_template=f.chat_template, spec=spec, compress_ratios=f.compress_ratios,
                          qsa_budget=f.qsa_budget, devices=f.devices, layer_split=f.layer_split,
                          tensor_split=f.tensor_split, draft_device=f.spec_draft_device, draft_rank=f.spec_draft_rank,
                          pipeline_parallel_size=f.pipeline_parallel_size, pipeline_depth=f.pipeline_depth,
                          pipeline_timeout=f.pipeline_timeout)
    settings = ServerSettings(host=f.host, port=f.port, alias=f.alias, api_key=f.api_key, body_limit=f.body_limit,
                              drain_timeout=f.drain_timeout, queue_limit=f.queue_limit, timeout=f.timeout,
                              stream_interval=f.stream_interval_ms / 1000)
    return engine, settings


def parse(argv: Sequence[str] | None = None) -> tuple[EngineConfig, ServerSettings]:
    """Raises FlagError for a flag's own value, ConfigError for a combination."""
    return configs(parse_flags(argv))
