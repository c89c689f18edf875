"""The engine's config and the server's settings, built from the parsed command-line flags."""
from __future__ import annotations

from typing import Sequence

from engine.drafter import SpecConfig
from engine.engine import EngineConfig
from engine.options import SPEC_TYPES
from server.flags import ServerFlags, parse_flags
from server.state import ServerSettings


def configs(f: ServerFlags) -> tuple[EngineConfig, ServerSettings]:
    """Raises ConfigError (naming the field) for a combination of flags the engine cannot run."""
    spec = None
    if f.spec_type is not None:
        spec = SpecConfig(type=SPEC_TYPES[f.spec_type], draft_model=f.spec_draft_model, n_max=f.spec_draft_n_max,
                          n_min=f.spec_draft_n_min, p_min=f.spec_draft_p_min, ngram_n=f.spec_ngram_size_n)
    engine = EngineConfig(model=f.model, dtype=f.dtype, ctx_size=f.ctx_size, parallel=f.parallel,
                          batch_size=f.batch_size, ubatch_size=f.ubatch_size, cache_type=f.cache_type_k,
                          cache_type_v=f.cache_type_v, kv_unified=f.kv_unified, threads=f.threads,
                          chat_template=f.chat_template, spec=spec, compress_ratios=f.compress_ratios,
                          qsa_budget=f.qsa_budget, devices=f.devices, layer_split=f.layer_split,
                          tensor_split=f.tensor_split, draft_device=f.spec_draft_device,
                          pipeline_parallel_size=f.pipeline_parallel_size, pipeline_depth=f.pipeline_depth,
                          pipeline_timeout=f.pipeline_timeout)
    settings = ServerSettings(host=f.host, port=f.port, alias=f.alias, api_key=f.api_key, body_limit=f.body_limit,
                              drain_timeout=f.drain_timeout, queue_limit=f.queue_limit, timeout=f.timeout)
    return engine, settings


def parse(argv: Sequence[str] | None = None) -> tuple[EngineConfig, ServerSettings]:
    """Raises FlagError for a flag's own value, ConfigError for a combination."""
    return configs(parse_flags(argv))
