"""Command-line flags, named as llama-server's, parsed into EngineConfig and ServerSettings."""
from __future__ import annotations

import argparse

from engine.drafter import SPEC_TYPES, SpecConfig
from engine.engine import EngineConfig
from engine.errors import ConfigError
from engine.kv_cache import KV_DTYPES
from engine.quant import DTYPES
from server.state import DEFAULT_BODY_LIMIT, ServerSettings


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m server", description="tandem: one model behind an OpenAI-style "
                                "HTTP server (flags as llama-server's)")
    p.add_argument("-m", "--model", default="default", help="HF directory, .gguf file, or 'default' (SmolLM2-135M)")
    p.add_argument("-c", "--ctx-size", type=int, default=4096, help="total context, split across the slots")
    p.add_argument("-np", "--parallel", type=int, default=1, help="slots: requests generated at once")
    p.add_argument("-b", "--batch-size", type=int, default=2048, help="most tokens one engine step takes")
    p.add_argument("-ub", "--ubatch-size", type=int, default=512, help="most prompt tokens one forward takes")
    p.add_argument("-t", "--threads", type=int, help="torch threads")
    p.add_argument("--dtype", choices=DTYPES, default="f32", help="weight format")
    p.add_argument("--kv-unified", action="store_true", help="one KV pool shared by all slots")
    p.add_argument("-ctk", "--cache-type-k", choices=list(KV_DTYPES),
                   help="KV cache type for K (default: the compute type, f32 or bf16 with --dtype bf16)")
    p.add_argument("-ctv", "--cache-type-v", choices=list(KV_DTYPES), help="for V (default: as K)")
    p.add_argument("--chat-template", help="a Jinja chat template file replacing the model's")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--alias", help="the model name served (requests may also say 'default')")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every endpoint but /health")
    p.add_argument("--body-limit", type=int, default=DEFAULT_BODY_LIMIT, help="largest request body, bytes")
    p.add_argument("--drain-timeout", type=float, default=60.0,
                   help="seconds in-flight requests get to finish after SIGTERM")
    p.add_argument("--spec-type", choices=sorted(SPEC_TYPES), help="drafter for speculative decoding")
    p.add_argument("-md", "--spec-draft-model", help="the MTP draft file (draft-mtp) or draft model (draft-simple)")
    p.add_argument("--spec-draft-n-min", type=int, default=0, help="draft fewer than this: decode normally")
    p.add_argument("--spec-draft-n-max", type=int, default=3, help="most tokens drafted per step")
    p.add_argument("--spec-draft-p-min", type=float, default=0.5,
                   help="stop drafting when the draft's top-1 probability is below this")
    p.add_argument("--spec-ngram-size-n", type=int, default=3, help="n-gram length ngram-simple looks up")
    p.add_argument("--spec-draft-device", choices=["cpu"], default="cpu", help="device the draft runs on")
    return p


def parse(argv: list[str] | None = None) -> tuple[EngineConfig, ServerSettings]:
    """Raises ConfigError (naming the flag) for a combination no single flag's parser can catch."""
    a = parser().parse_args(argv)
    if not 1 <= a.port <= 65535:
        raise ConfigError(f"--port={a.port}: must be in 1..65535")
    if a.body_limit < 1:
        raise ConfigError(f"--body-limit={a.body_limit}: must be >= 1")
    spec = None
    if a.spec_type is not None:
        spec = SpecConfig(type=SPEC_TYPES[a.spec_type], draft_model=a.spec_draft_model, n_max=a.spec_draft_n_max,
                          n_min=a.spec_draft_n_min, p_min=a.spec_draft_p_min, ngram_n=a.spec_ngram_size_n)
    engine = EngineConfig(model=a.model, dtype=a.dtype, ctx_size=a.ctx_size, parallel=a.parallel,
                          batch_size=a.batch_size, ubatch_size=a.ubatch_size, cache_type=a.cache_type_k,
                          cache_type_v=a.cache_type_v, kv_unified=a.kv_unified, threads=a.threads,
                          chat_template=a.chat_template, spec=spec)
    settings = ServerSettings(host=a.host, port=a.port, alias=a.alias, api_key=a.api_key, body_limit=a.body_limit,
                              drain_timeout=a.drain_timeout)
    return engine, settings
