"""Drafters: what proposes tokens for the target to verify, behind one interface (`Drafter`).

After every engine step the engine hands the drafter the span of positions the target just
committed for each running request (with the target's hidden states there). A drafter with a KV
cache of its own writes the same positions, so its cache always matches the target's, and
rollback is free: positions past the accepted ones are simply overwritten next step. For each
request that is decoding, the drafter then returns a `Draft` for the next step to verify.

This module holds the protocol, the span it reads and the loop shared by the drafters that run a
model (`CachedDrafter`); each drafter has its own module beside it.
"""
from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from engine.model.batch import Row
from engine.model.kv_cache import KVCache
from engine.sched.request import Draft, Request
from engine.sched.sampling import distribution, sample


@dataclass
class Span:
    """Positions start .. end-1 of the request's slot were committed this step; hidden [end-start, H]
    are the target's hidden states there (after its final norm). `room`: the most tokens a draft
    may hold, so that the verify row fits the slot."""
    request: Request
    start: int
    end: int
    hidden: torch.Tensor
    room: int


class Drafter(Protocol):
    """Called on the engine thread once per step with a span for every running request, prompt
    chunks included (a drafter with a cache must see every committed position). Returns a draft
    for each request that is decoding and has one; requests left out verify nothing next step.
    The engine owns the returned drafts, so two drafters can be asked and one draft kept per
    request."""
    # Whether spans must carry hidden states; such a drafter's cache entry at position i also
    # depends on token i+1, so the engine recomputes one more position of a reused prefix.
    needs_hidden: bool
    # Whether it keeps a KV cache of its own, which must see every committed position: a span it
    # is not given now must be given later (spec.runner's catch-up), or its cache has a gap.
    has_cache: bool

    def draft(self, spans: list[Span]) -> dict[Request, Draft]: ...

    def resident(self) -> tuple[torch.nn.Module, KVCache] | None:
        """The model and KV cache it holds on its device, for the footprint (None: no weights)."""


def top_tokens(logits: torch.Tensor, vocab_ids: torch.Tensor | None, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """Each row's k most likely tokens (full-vocabulary ids) and their probabilities, best first,
    from drafter logits [R, V'] (over `vocab_ids` when given), in one pass for the whole batch."""
    top, best = torch.softmax(logits, -1).topk(k, -1)
    return (vocab_ids[best] if vocab_ids is not None else best).tolist(), top.tolist()


@dataclass
class Choice:
    token: int
    top: float  # the row's top-1 probability, which p_min reads whether the request samples or not
    q: torch.Tensor | None  # the full-vocabulary distribution the token was drawn from, when sampled
    siblings: list[int]  # the row's next most likely tokens (not `token`) that may stand beside it
    # The top-1 probability plus that of the next width-1 tokens of at least p_sibling: what a
    # depth's candidates hold together, read from the row alone (never from a sampled token).
    mass: float


def _choose_drafts(logits: torch.Tensor, reqs: list[Request], vocab_ids: torch.Tensor | None, vocab: int,
                   width: int, p_sibling: float) -> list[Choice]:
    """A draft token from each row of drafter logits [R, V'] (over `vocab_ids` when given), for reqs[r],
    with up to width-1 siblings of at least p_sibling probability."""
    ids, probs = top_tokens(logits, vocab_ids, width)
    out = []
    for row, req, ranked, p in zip(logits, reqs, ids, probs):
        token, q = ranked[0], None
        if not req.params.greedy:
            full = row if vocab_ids is None else torch.full((vocab,), -math.inf).index_copy_(0, vocab_ids, row)
            q = distribution(full, req.params)
            token = sample(q, req.generator)
        out.append(Choice(token, p[0], q, _siblings(ranked, p, token, width, p_sibling),
                          p[0] + sum(pt for pt in p[1:width] if pt >= p_sibling)))
    return out


def _siblings(ranked: list[int], probs: list[float], token: int, width: int, p_sibling: float) -> list[int]:
    """Up to width-1 of a row's ranked tokens, other than the chain's `token`, of at least p_sibling."""
    return [t for t, p in zip(ranked, probs) if t != token and p >= p_sibling][:width - 1]


def as_draft(tokens: list[int], qs: list, n_min: int, siblings: list[tuple[int, int]] | None = None) -> Draft:
    if len(tokens) < n_min:
        return Draft()
    return Draft(tokens, torch.stack(qs) if qs and qs[0] is not None else None, siblings or [])


# A choice made per request from the drafter model's depth-1 logits (over its vocab_ids): given the
# span, that logits row and the draft's length limit, a draft to take instead of the model's
# deeper ones, or None to let the model draft.
Override = Callable[[Span, torch.Tensor, int], Draft | None]


class CachedDrafter(ABC):
    """Shared loop of the drafters that run a model with their own KV cache: catch up on the
    committed span, then draft one token per forward, batched across requests."""
    needs_hidden: bool
    vocab_ids: torch.Tensor | None = None  # full-vocabulary id of each logit, when over a subset

    def __init__(self, cache, vocab: int, width: int = 1, p_sibling: float = 0.0):
        """width, p_sibling: SpecConfig's, candidates per depth and a sibling's least probability."""
        self.cache, self.vocab = cache, vocab
        self.width, self.p_sibling = width, p_sibling

    has_cache = True

    def resident(self) -> tuple[torch.nn.Module, KVCache]:
        return self.model, self.cache

    @abstractmethod
    def catch_up_rows(self, span: Span) -> tuple[Row, torch.Tensor | None]:
        """The drafter's rows for a committed span, and the hidden states they take (or None)."""

    @abstractmethod
    def run(self, depth: int, rows: list[Row], hidden: torch.Tensor | None,
            at: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Forward of `rows`; returns (per-token state for the next depth, logits [len(at), V'] at
        the tokens `at` indexes, or at every token when it is None)."""

    @torch.inference_mode()
    def draft(self, spans: list[Span], override: Override | None = None) -> dict[Request, Draft]:
        """override: asked for each decoding request once the catch-up has given the depth-1
        logits; a draft it returns is the request's (with siblings of its first token from those
        logits), and the model drafts no deeper for it."""
        if not spans:
            return {}
        rows, hiddens = zip(*(self.catch_up_rows(s) for s in spans))
        hidden = torch.cat(hiddens) if hiddens[0] is not None else None
        # The head runs only at the last catch-up token of a request that drafts: a prompt chunk's
        # rows, and those of a request with no room to draft, only fill the cache.
        drafting, last = [], []
        for span, row, end in zip(spans, rows, itertools.accumulate(len(row.tokens) for row in rows)):
            if not span.request.prefilling and min(span.request.draft_limits.n_max, span.room) > 0:
                drafting.append(_Drafting(span, row.start + len(row.tokens), len(last)))
                last.append(end - 1)
        at = torch.tensor(last, dtype=torch.long)
        state, logits = self.run(1, list(rows), hidden, at)
        state = state[at.to(state.device)] if state is not None else None
        drafts = {}
        active = []
        for item in drafting:
            chosen = override(item.span, logits[item.row], item.limit) if override is not None else None
            if chosen is None:
                active.append(item)
                continue
            if chosen.tokens:
                (ranked,), (probs,) = top_tokens(logits[item.row][None], self.vocab_ids, self.width)
                item.add_siblings(0, _siblings(ranked, probs, chosen.tokens[0], self.width, self.p_sibling))
                chosen.siblings = item.siblings
            drafts[item.request] = chosen
        # Each depth drafts for the requests still going: a request leaves when its draft is as
        # long as its limit or the draft's top-1 probability falls below its p_min.
        going, depth = active, 1
        while going:
            rows_at = torch.tensor([item.row for item in going])
            choices = _choose_drafts(logits[rows_at], [item.request for item in going], self.vocab_ids, self.vocab,
                                     self.width, self.p_sibling)
            still = []
            for item, choice in zip(going, choices):
                p_min = item.request.draft_limits.p_min
                # Below p_min the chain goes no deeper, but a tree still verifies the depth's
                # candidates when together they hold p_min of the draft's probability.
                if choice.top < p_min and not (choice.siblings and choice.mass >= p_min):
                    continue
                item.tokens.append(choice.token)
                item.qs.append(choice.q)
                item.add_siblings(depth - 1, choice.siblings)
                if len(item.tokens) < item.limit and choice.top >= p_min:
                    still.append(item)
            if not still:
                break
            depth += 1
            rows = [Row(item.request.slot, item.position + depth - 2, [item.tokens[-1]]) for item in still]
            prev = state[torch.tensor([item.row for item in still]).to(state.device)] if state is not None else None
            state, logits = self.run(depth, rows, prev)
            for j, item in enumerate(still):
                item.row = j
            going = still
        drafts.update((item.request, as_draft(item.tokens, item.qs, item.request.draft_limits.n_min, item.siblings))
                      for item in active)
        return drafts


@dataclass
class _Drafting:
    """One request's draft while CachedDrafter.draft builds it."""
    span: Span
    position: int  # where its first draft token goes
    row: int  # its row in the latest depth's state and logits
    tokens: list[int] = field(default_factory=list)
    qs: list = field(default_factory=list)
    siblings: list[tuple[int, int]] = field(default_factory=list)

    @property
    def request(self) -> Request:
        return self.span.request

    @property
    def limit(self) -> int:
        """The chain's most tokens."""
        return min(self.request.draft_limits.n_max, self.span.room)

    def add_siblings(self, depth: int, tokens: list[int]) -> None:
        """Siblings of the chain's token at `depth`, as many as the slot's room leaves beside a
        whole chain and the siblings already taken (the verify row must fit the slot)."""
        free = self.span.room - self.limit - len(self.siblings)
        self.siblings.extend((depth, t) for t in tokens[:max(0, free)])
