"""Request: one generation's whole state, owned by the engine thread once submitted."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from engine.model.probe import LayerProbe, ProbeCapture
from engine.sched.sampling import SamplingParams
from engine.settings import DraftLimits


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


@dataclass
class Draft:
    """Tokens proposed to follow a request's last token, in order, and when the request samples
    the distributions they were drawn from. Siblings make it a small tree: (depth, token) is an
    alternative to tokens[depth] after tokens[:depth], verified in the same forward and tried, in
    order, only where tokens[depth] is rejected. A sibling is deterministic (its q is one-hot).
    A draft a grammar cut (engine.sched.grammar) ends before the chain token it refused: siblings
    may stand at depth len(tokens), and the refused token's distribution is kept for acceptance."""
    tokens: list[int] = field(default_factory=list)
    q: torch.Tensor | None = None  # [len(tokens), vocab]
    siblings: list[tuple[int, int]] = field(default_factory=list)
    cut: bool = False  # a grammar refused tokens[len(tokens)] as drafted, and cut it off
    refused_q: torch.Tensor | None = None  # [vocab]: the cut token's q, when the request samples

    @property
    def drafted(self) -> int:
        """Tokens the drafter proposed along the chain, a refused one included."""
        return len(self.tokens) + self.cut

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
    """Owned by the engine thread once submitted; its state changes through the methods below,
    which keep the counters consistent (the scheduler admits, preempts and commits; the engine
    appends outputs and finishes)."""
    id: str
    token_ids: list[int]  # the prompt, then each output token as it is emitted (copied on creation)
    params: SamplingParams
    on_output: Callable[[StepOutput], None]
    cache_prompt: bool = True
    pinned_slot: int | None = None  # a slot the client asked for (llama-server's id_slot), or None for any
    draft_limits: DraftLimits | None = None  # set by Engine.submit when the engine drafts
    generator: torch.Generator | None = None
    probe: ProbeCapture | None = None  # an attention probe, capturing while the prompt runs
    # The matcher of a grammar its tokens follow (engine.sched.grammar.Constraint, which imports
    # this module), or None.
    constraint: Any = None
    n_prompt: int = field(init=False)
    status: Status = field(default=Status.WAITING, init=False)
    slot: int | None = field(default=None, init=False)  # the slot it runs in, while it runs
    num_computed: int = field(default=0, init=False)  # tokens of prompt + output whose K/V are in the cache
    cache_n: int = field(default=0, init=False)  # prompt tokens reused from the slot's cache
    recomputed_n: int = field(default=0, init=False)  # positions computed again after preemption
    dropped_n: int = field(default=0, init=False)  # positions its preemption dropped, while it waits to resume
    finish_reason: str | None = field(default=None, init=False)
    draft: Draft = field(default_factory=Draft, init=False)  # proposed for the next step's verification
    draft_n: int = field(default=0, init=False)
    draft_n_accepted: int = field(default=0, init=False)
    # The target's hidden state at the position before its first computed one, where it resumed a
    # recurrent model's snapshot (Scheduler.keep_hidden): what an MTP draft pairs with that token,
    # handed to the drafter with the first committed span (as if that position were committed too).
    resume_hidden: torch.Tensor | None = field(default=None, init=False)
    probe_result: list[LayerProbe] | None = field(default=None, init=False)  # set when the prompt has run
    t_submitted: float = field(default_factory=time.perf_counter, init=False)
    t_started: float = field(default=0.0, init=False)
    t_first_token: float = field(default=0.0, init=False)
    t_finished: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        self.n_prompt = len(self.token_ids)

    @property
    def prompt_ids(self) -> list[int]:
        return self.token_ids[:self.n_prompt]

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.n_prompt:]

    @property
    def n_output(self) -> int:
        return len(self.token_ids) - self.n_prompt

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    @property
    def prefill_ids(self) -> list[int]:
        """The tokens whose K/V must be computed before the request decodes: its prompt, or after
        preemption everything but the last token, which the next decode row writes."""
        return self.token_ids[:-1] if self.n_output else self.token_ids

    @property
    def prefilling(self) -> bool:
        return self.num_computed < len(self.token_ids) - (1 if self.n_output else 0)

    @property
    def prompt_n(self) -> int:
        return self.n_prompt - self.cache_n

    # -- state changes ------------------------------------------------------------------------

    def admit(self, slot: int, reuse: int, now: float) -> None:
        """Into `slot`, with its first `reuse` positions already cached: a fresh request counts
        them as its cache_n; a resumed one counts what it must compute again."""
        self.slot, self.num_computed, self.status = slot, reuse, Status.RUNNING
        if self.dropped_n:
            self.recomputed_n += max(0, self.dropped_n - reuse)
            self.dropped_n = 0
        else:
            self.cache_n, self.t_started = reuse, now

    def preempt(self) -> None:
        """Out of its slot, its positions dropped; its tokens, sampler state and counters stay."""
        self.dropped_n = self.num_computed
        self.slot, self.num_computed, self.status = None, 0, Status.WAITING
        self.draft = Draft()

    def commit(self, n: int) -> None:
        """n more positions' K/V are in the slot."""
        self.num_computed += n

    def count_drafts(self, drafted: int, accepted: int) -> None:
        self.draft_n += drafted
        self.draft_n_accepted += accepted

    def take(self, tokens: list[int], eos_ids: frozenset[int], ctx: int, now: float) -> tuple[list[int], str | None]:
        """Append a step's tokens up to a stop token, max_tokens or the slot's end (ctx positions);
        returns the tokens appended and why the request ends (None: it goes on)."""
        if not self.t_first_token:
            self.t_first_token = now
        params, new, reason = self.params, [], None
        for token in tokens:
            if token in params.stop_token_ids or (token in eos_ids and not params.ignore_eos):
                reason = "stop"
                break
            new.append(token)
            if self.n_output + len(new) >= params.max_tokens:
                reason = "length"
                break
        # The newest token is written at num_computed next step; the slot must have room for it.
        if reason is None and self.num_computed + 1 >= ctx:
            reason = "length"
        self.token_ids.extend(new)
        return new, reason

    def finish(self, reason: str) -> None:
        self.finish_reason, self.status, self.t_finished = reason, Status.FINISHED, time.perf_counter()

    def timings(self, end: float | None = None, predicted_n: int | None = None) -> RequestTimes:
        """As the engine finished it, or as a caller that ended it early (a stop string, a time
        limit, a client gone) saw it: at `end`, with `predicted_n` of its tokens delivered."""
        end = end or self.t_finished or time.perf_counter()
        first = self.t_first_token or end
        return RequestTimes(
            cache_n=self.cache_n, prompt_n=self.prompt_n,
            prompt_ms=1000.0 * (first - self.t_started) if self.t_started else 0.0,
            predicted_n=self.n_output if predicted_n is None else predicted_n,
            predicted_ms=1000.0 * (end - first),
            draft_n=self.draft_n, draft_n_accepted=self.draft_n_accepted, recomputed_n=self.recomputed_n,
            probe_recomputed=self.probe is not None and self.probe.spec.recomputes,
        )
