"""One benchmark record per request, and the rule that says whether it measured what was asked.

A record is kept whatever happened to its request: an HTTP error, a cut stream, a reused cache
prefix or a short generation makes it invalid with a reason, and summaries count those reasons
instead of dropping the record (docs/architecture.md, "Benchmark records")."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

INTERRUPTED = "interrupted"


@dataclass
class Record:
    lane: int
    run: int
    prompt_tokens: int  # asked for
    gen_tokens: int  # asked for
    start_s: float  # request sent, seconds since the session began (intervals show overlap)
    end_s: float | None = None  # stream ended
    # Counts as the server reports them. cache_n is None when the server sent no `timings`:
    # prompt_n and predicted_n then come from `usage`, and cache reuse is unknown.
    cache_n: int | None = None
    prompt_n: int | None = None
    predicted_n: int | None = None
    usage_prompt_tokens: int | None = None
    usage_completion_tokens: int | None = None
    prompt_per_second: float | None = None
    predicted_per_second: float | None = None
    draft_n: int | None = None
    draft_n_accepted: int | None = None
    timings_source: str | None = None  # "server" (its `timings`) or "client" (usage and arrival times)
    finish_reason: str | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    itl_ms: list[float] = field(default_factory=list)  # gaps between content chunks
    error: str | None = None  # why the request did not complete (HTTP error, cut stream, interrupted)

    @property
    def cache_known(self) -> bool:
        return self.cache_n is not None

    @property
    def invalid_reason(self) -> str | None:
        """None when the server processed exactly the requested fresh prompt and generated exactly
        gen_tokens, and its timings agree with its usage; else every broken condition, '; '-joined."""
        if self.error is not None:
            return self.error
        if self.usage_prompt_tokens is None or self.prompt_n is None or self.predicted_n is None:
            return "no usage in the final chunk"
        reasons = []
        if self.cache_n:
            reasons.append(f"cache_n={self.cache_n}: prompt tokens reused from the cache")
        if self.prompt_n != self.prompt_tokens:
            reasons.append(f"prompt_n={self.prompt_n} != prompt_tokens={self.prompt_tokens}")
        if self.predicted_n != self.gen_tokens:
            reasons.append(f"predicted_n={self.predicted_n} != gen_tokens={self.gen_tokens} "
                           f"(finish_reason={self.finish_reason})")
        if self.usage_prompt_tokens != (self.cache_n or 0) + self.prompt_n:
            reasons.append(f"usage.prompt_tokens={self.usage_prompt_tokens} != cache_n + prompt_n")
        if self.usage_completion_tokens != self.predicted_n:
            reasons.append(f"usage.completion_tokens={self.usage_completion_tokens} != predicted_n")
        return "; ".join(reasons) or None

    @property
    def valid(self) -> bool:
        return self.invalid_reason is None

    def to_dict(self) -> dict:
        return {**dataclasses.asdict(self), "cache_known": self.cache_known, "valid": self.valid,
                "invalid_reason": self.invalid_reason}

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict) -> "Record":
        """Reads back what to_dict wrote; the derived keys are recomputed, not trusted."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def read_jsonl(path) -> list[Record]:
    with open(path) as f:
        return [Record.from_dict(json.loads(line)) for line in f if line.strip()]
