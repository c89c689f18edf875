"""The engine's named choices as plain strings: weight formats, KV cache types, drafters.

Stdlib only, so the server's flag parser (and the proxy, through it) can check a value against them
without importing torch. The engine modules key their torch types by these names."""
from __future__ import annotations

from dataclasses import dataclass

# Weight formats; "auto": each tensor as the file stores it (GGUF's q4_0, q4_1, q8_0 blocks), else f32.
DTYPES = ("f32", "bf16", "int8", "q4_0", "q4_1", "q8_0", "auto")
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0")
# Drafter names as llama-server spells them, and short aliases, each to its canonical name.
SPEC_TYPES = {"draft-mtp": "draft-mtp", "mtp": "draft-mtp", "ngram-simple": "ngram-simple",
              "ngram": "ngram-simple", "draft-simple": "draft-simple", "draft": "draft-simple",
              "draft-mtp-ngram": "draft-mtp-ngram", "mtp-ngram": "draft-mtp-ngram"}
# The --spec-type that turns speculation off, as llama-server spells it; not a drafter.
SPEC_NONE = "none"


@dataclass(frozen=True)
class CompressRatios:
    """`--compress-ratios` as given, checked for syntax only (the layer counts come from the model):
    a comma list of ratios (the trunk's layers, or the trunk's then the draft's), or a pattern over
    the trunk's layers: `everyN:R` (ratio R on layers N-1, 2N-1, ...: every Nth, counting from 1),
    `all:R`, or `none`. A ratio is 0 (dense) or >= 2 (QSA)."""
    values: tuple[int, ...] = ()  # the list form
    every: int = 0  # the pattern form: every Nth trunk layer (1: all of them) ...
    ratio: int = 0  # ... gets this ratio, the others 0

    @classmethod
    def parse(cls, text: str) -> "CompressRatios":
        """Raises ValueError with the rule a malformed value breaks."""
        rule = "must be a comma list of ratios (0 or >= 2), everyN:R, all:R or none"
        text = text.strip()
        if text == "none":
            return cls(every=1, ratio=0)
        name, colon, value = text.partition(":")
        if colon:
            every = 1 if name == "all" else int(name[5:]) if name.startswith("every") and name[5:].isdigit() else 0
            if every < 1 or not value.isdigit() or int(value) < 2:
                raise ValueError(rule)
            return cls(every=every, ratio=int(value))
        parts = text.split(",")
        if not all(p.strip().isdigit() for p in parts) or any(int(p) == 1 for p in parts):
            raise ValueError(rule)
        return cls(values=tuple(int(p) for p in parts))

    def expand(self, trunk: int) -> tuple[int, ...]:
        """The ratios for `trunk` layers, then any the list gives beyond them (the draft's)."""
        if self.values:
            return self.values
        return tuple(self.ratio if (i + 1) % self.every == 0 else 0 for i in range(trunk))
