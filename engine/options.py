"""The engine's named choices as plain strings: weight formats, KV cache types, drafters.

Stdlib only, so the server's flag parser (and the proxy, through it) can check a value against them
without importing torch. The engine modules key their torch types by these names."""
from __future__ import annotations

DTYPES = ("f32", "bf16", "int8")  # weight formats
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0")
# Drafter names as llama-server spells them, and short aliases, each to its canonical name.
SPEC_TYPES = {"draft-mtp": "draft-mtp", "mtp": "draft-mtp", "ngram-simple": "ngram-simple",
              "ngram": "ngram-simple", "draft-simple": "draft-simple", "draft": "draft-simple"}
