"""Request: one generation's whole state, owned by the engine thread once submitted."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from engine.probe import LayerProbe, ProbeCapture
from engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class RequestTimes:
    """What one request took, as counts and milliseconds; the server shapes them into llama-server's
    `timings` (server.protocol.Timings)."""
    cache_n: int
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    draft_n: int = 0
    draft_n_accepted: int = 0
    recomputed_n: int = 0  # positions computed again after preemption, beyond prompt_n
    probe_recomputed: bool = False  # the prompt ran whole, its cached prefix unused, for an attention probe


@dataclass(frozen=True)
class DraftLimits:
    """How much one request drafts per step, llama-server's names: the server's --spec-draft-*
    settings, or the request's own `speculative.n_max`, `n_min` and `p_min`
    (engine.drafter.SpecConfig.request_limits checks them against the server's)."""
    n_max: int  # 0: no drafts for this request
    n_min: int
    p_min: float


@dataclass
class Draft:
    """Tokens proposed to follow a request's last token, in order, and when the request samples
    the distributions they were drawn from. Siblings make it a small tree: (depth, token) is an
    alternative to tokens[depth] after tokens[:depth], verified in the same forward and tried, in
    order, only where tokens[depth] is rejected. A sibling is deterministic (its q is one-hot)."""
    tokens: list[int] = field(default_factory=list)
    q: torch.Tensor | None = None  # [len(tokens), vocab]
    siblings: list[tuple[int, int]] = field(default_factory=list)

    @property
    def row(self) -> list[int]:
        """The verify row's tokens after the request's last one: the chain, then the siblings."""
        return self.tokens + [t for _, t in self.siblings]

    @property
    def depths(self) -> list[int] | None:
        """Each verify row token's depth (engine.batch.Row), None for a chain."""
        if not self.siblings:
            return None
        return list(range(len(self.tokens) + 1)) + [d + 1 for d, _ in self.siblings]


@dataclass
class StepOutput:
    """What one engine step produced for one request (delivered on the engine thread)."""
    request: "Request"
    token_ids: list[int]
    finished: bool
    logprobs: list[dict] | None = None


@dataclass(eq=False)
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    on_output: Callable[[StepOutput], None]
    cache_prompt: bool = True
    slot_id: int | None = None  # a slot the client asked for, or None for any
    status: Status = Status.WAITING
    output_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    cache_n: int = 0  # prompt tokens reused from the slot's cache
    recomputed_n: int = 0  # positions computed again after preemption (the prompt's and outputs')
    dropped_n: int = 0  # positions its preemption dropped, while it waits to resume (else 0)
    num_computed: int = 0  # tokens of prompt + output whose K/V are in the cache
    finish_reason: str | None = None
    draft_n: int = 0
    draft_n_accepted: int = 0
    draft: Draft = field(default_factory=Draft)  # proposed for the next step's verification
    draft_limits: DraftLimits | None = None  # set by Engine.submit when the engine drafts
    generator: torch.Generator | None = None
    probe: ProbeCapture | None = None  # an attention probe, capturing while the prompt runs
    probe_result: list[LayerProbe] | None = None  # set when the prompt has run (engine/probe.py)
    t_submitted: float = field(default_factory=time.perf_counter)
    t_started: float = 0.0
    t_first_token: float = 0.0
    t_finished: float = 0.0

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def prefill_ids(self) -> list[int]:
        """The tokens whose K/V must be computed before the request decodes: its prompt, or after
        preemption everything but the last token, which the next decode row writes."""
        return self.all_ids[:-1] if self.output_ids else self.prompt_ids

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.prompt_ids) + max(0, len(self.output_ids) - 1)

    @property
    def prompt_n(self) -> int:
        return len(self.prompt_ids) - self.cache_n

    def timings(self, end: float | None = None, predicted_n: int | None = None) -> RequestTimes:
        """As the engine finished it, or as a caller that ended it early (a stop string, a time
        limit, a client gone) saw it: at `end`, with `predicted_n` of its tokens delivered."""
        end = end or self.t_finished or time.perf_counter()
        first = self.t_first_token or end
        return RequestTimes(
            cache_n=self.cache_n, prompt_n=self.prompt_n,
            prompt_ms=1000.0 * (first - self.t_started) if self.t_started else 0.0,
            predicted_n=len(self.output_ids) if predicted_n is None else predicted_n,
            predicted_ms=1000.0 * (end - first),
            draft_n=self.draft_n, draft_n_accepted=self.draft_n_accepted, recomputed_n=self.recomputed_n,
            probe_recomputed=self.probe is not None and self.probe.spec.recomputes,
        )
