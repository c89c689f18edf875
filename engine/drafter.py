"""Drafters: what proposes tokens for the target to verify, behind one interface (`Drafter`).

After every engine step the engine hands the drafter the span of positions the target just
committed for each running request (with the target's hidden states there). A drafter with a KV
cache of its own writes the same positions, so its cache always matches the target's, and
rollback is free: positions past the accepted ones are simply overwritten next step. For each
request that is decoding, the drafter then returns a `Draft` for the next step to verify.
"""
from __future__ import annotations

import itertools
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from engine import mtp
from engine.batch import ForwardBatch, Row
from engine.blocks import FORMATS
from engine.config import ModelConfig
from engine.errors import ConfigError, check_rules
from engine.kv_cache import KVCache
from engine.model import Transformer, embedding_table
from engine.ngram import ngram_draft
from engine.placement import Placement
from engine.qsa import LayerSpec
from engine.options import SPEC_TYPES
from engine.quant import compute_dtype, keeps_blocks
from engine.request import Draft, DraftLimits, Request
from engine.sampling import distribution, sample
from engine.weights import open_model


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings, llama-server's names. An MTP draft_model of "default" becomes
    the path of the draft the engine ships (mtp.DEFAULT_DRAFT), so everything downstream (its
    checks, /props, the footprint) sees the file."""
    type: str  # canonical: draft-mtp, draft-mtp-ngram, ngram-simple or draft-simple
    draft_model: str | None = None
    n_max: int = 3
    n_min: int = 0
    p_min: float = 0.5
    ngram_n: int = 3
    # Speculate only while at most this many requests decode (0: always). Each decoding request
    # adds 1 + n_max verify rows, and on a CPU a step of many rows is bound by arithmetic, not by
    # reading the weights: there a draft accepted 40% of the time costs more than it saves.
    max_batch: int = 0
    # Candidates per depth: the chain's token and up to width-1 siblings, the draft's next most
    # likely tokens with at least p_sibling probability each (request.Draft). 1: a chain.
    width: int = 1
    p_sibling: float = 0.1

    def __post_init__(self) -> None:
        if self.runs_mtp and self.draft_model == "default":
            object.__setattr__(self, "draft_model", str(mtp.DEFAULT_DRAFT))
        check_rules([
            (self.type in SPEC_TYPES.values(), "spec_type", self.type, f"must be one of {', '.join(SPEC_TYPES)}"),
            (self.n_max >= 1, "spec_draft_n_max", self.n_max, "must be >= 1"),
            (0 <= self.n_min <= self.n_max, "spec_draft_n_min", self.n_min,
             f"must be in 0..spec_draft_n_max={self.n_max}"),
            (0 <= self.p_min <= 1 and not math.isnan(self.p_min), "spec_draft_p_min", self.p_min, "must be in [0, 1]"),
            (self.ngram_n >= 1, "spec_ngram_size_n", self.ngram_n, "must be >= 1"),
            (self.max_batch >= 0, "spec_max_batch", self.max_batch, "must be >= 0 (0: no limit)"),
            (1 <= self.width <= 8, "spec_draft_width", self.width, "must be in 1..8"),
            (self.width == 1 or self.type != "ngram-simple", "spec_draft_width", self.width,
             "must be 1 with spec_type=ngram-simple: siblings come from a draft model's distribution"),
            (0 <= self.p_sibling <= 1 and not math.isnan(self.p_sibling), "spec_draft_p_sibling", self.p_sibling,
             "must be in [0, 1]"),
            (self.type == "ngram-simple" or self.draft_model, "spec_draft_model", self.draft_model,
             f"is required with spec_type={self.type}"),
        ])

    @property
    def runs_mtp(self) -> bool:
        """Whether a detached MTP draft runs (alone, or with the n-gram lookup)."""
        return self.type in ("draft-mtp", "draft-mtp-ngram")

    @property
    def verify_rows(self) -> int:
        """The most tokens a decode row verifies after its last one: the chain and its siblings."""
        return self.n_max * self.width

    @property
    def limits(self) -> DraftLimits:
        """What a request that gives no limits of its own drafts under."""
        return DraftLimits(self.n_max, self.n_min, self.p_min)

    def request_limits(self, n_max: int | None = None, n_min: int | None = None,
                       p_min: float | None = None) -> DraftLimits:
        """A request's own limits (llama-server's `speculative.n_max`, `n_min`, `p_min`), the
        server's where it gives none. Their ranges are checked at the edge (server.protocol); here
        the rules that need the server's settings: n_max fits the verify rows, which are sized for
        spec_draft_n_max, and a given n_min is at most the request's n_max. The server's n_min
        shrinks to a smaller n_max, as llama-server clamps it."""
        n_max = self.n_max if n_max is None else n_max
        check_rules([
            (n_max <= self.n_max, "speculative.n_max", n_max,
             f"must be <= the server's --spec-draft-n-max={self.n_max} (its verify rows are sized for it)"),
            (n_min is None or n_min <= n_max, "speculative.n_min", n_min, f"must be in 0..speculative.n_max={n_max}"),
        ])
        return DraftLimits(n_max, min(self.n_min, n_max) if n_min is None else n_min,
                           self.p_min if p_min is None else p_min)


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
    # The part that runs a draft model with a KV cache of its own, placed on the draft's device
    # (None: the drafter has no weights).
    cached: "CachedDrafter | None"

    def draft(self, spans: list[Span]) -> dict[Request, Draft]: ...


def _ranked(logits: torch.Tensor, vocab_ids: torch.Tensor | None, k: int) -> tuple[list[list[int]], list[list[float]]]:
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
    ids, probs = _ranked(logits, vocab_ids, width)
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


def _as_draft(tokens: list[int], qs: list, n_min: int, siblings: list[tuple[int, int]] | None = None) -> Draft:
    if len(tokens) < n_min:
        return Draft()
    return Draft(tokens, torch.stack(qs) if qs and qs[0] is not None else None, siblings or [])


def _lookup_draft(req: Request, tokens: list[int], vocab: int) -> Draft:
    """The draft of tokens the n-gram lookup found for req. A deterministic draft is a one-hot q:
    the acceptance rule then keeps it with p(x)."""
    qs = [torch.nn.functional.one_hot(torch.tensor(t), vocab).float() for t in tokens] \
        if not req.params.greedy else [None] * len(tokens)
    return _as_draft(tokens, qs, req.draft_limits.n_min)


class NgramDrafter:
    needs_hidden = False
    cached = None

    def __init__(self, spec: SpecConfig, vocab: int):
        self.spec, self.vocab = spec, vocab

    def draft(self, spans: list[Span]) -> dict[Request, Draft]:
        drafts = {}
        for span in spans:
            req = span.request
            if req.prefilling:
                continue
            tokens = ngram_draft(req.all_ids, self.spec.ngram_n, min(req.draft_limits.n_max, span.room))
            drafts[req] = _lookup_draft(req, tokens, self.vocab)
        return drafts


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

    @property
    def cached(self) -> "CachedDrafter":
        return self

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
                (ranked,), (probs,) = _ranked(logits[item.row][None], self.vocab_ids, self.width)
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
        drafts.update((item.request, _as_draft(item.tokens, item.qs, item.request.draft_limits.n_min, item.siblings))
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


class MTPDrafter(CachedDrafter):
    """The detached MTP draft: position i of its cache holds (target hidden h_i, token x_{i+1})."""
    needs_hidden = True

    def __init__(self, draft, target, cache, vocab: int, width: int = 1, p_sibling: float = 0.0):
        super().__init__(cache, vocab, width, p_sibling)
        self.model, self.target = draft, target
        self.vocab_ids = draft.vocab_ids
        self.embed_tokens = target.embed_tokens if draft.embed is None else draft.embed_tokens

    def catch_up_rows(self, span: Span):
        ids = span.request.all_ids
        return Row(span.request.slot, span.start, ids[span.start + 1:span.end + 1]), span.hidden

    def run(self, depth, rows, hidden, at=None):
        batch = ForwardBatch.build(rows)
        embeddings = self.embed_tokens(batch.token_ids)
        return self.model(depth, hidden.to(embeddings.dtype), embeddings, batch, self.cache, at)


class MTPNgramDrafter:
    """draft-mtp-ngram: the MTP draft, or the n-gram lookup's continuation where the context offers
    one the draft agrees with. Per request and step, after the MTP draft has caught up on the
    committed span (its cache must see every position), the lookup's continuation (at least n_min
    tokens) is the draft when its first token is the MTP draft's depth-1 top-1 token, or when that
    top-1 probability is below p_min (the MTP draft would propose nothing); otherwise the MTP
    draft drafts as draft-mtp does. The rule reads the top-1 token, never a sampled one, so a
    sampling request's one-hot q is the distribution its n-gram draft was really drawn from."""
    needs_hidden = True

    def __init__(self, mtp_drafter: MTPDrafter, ngram_n: int):
        self.cached, self.ngram_n = mtp_drafter, ngram_n
        self.lookup_drafts = 0  # drafts the n-gram lookup gave: how often it won

    def draft(self, spans: list[Span]) -> dict[Request, Draft]:
        return self.cached.draft(spans, self._lookup)

    def _lookup(self, span: Span, logits: torch.Tensor, limit: int) -> Draft | None:
        req = span.request
        tokens = ngram_draft(req.all_ids, self.ngram_n, limit)
        if not tokens or len(tokens) < req.draft_limits.n_min:
            return None
        (ranked,), (probs,) = _ranked(logits[None], self.cached.vocab_ids, 1)
        if tokens[0] != ranked[0] and probs[0] >= req.draft_limits.p_min:
            return None
        self.lookup_drafts += 1
        return _lookup_draft(req, tokens, self.cached.vocab)


class DraftModelDrafter(CachedDrafter):
    """A smaller model with the same vocabulary, run autoregressively on its own cache."""
    needs_hidden = False

    def __init__(self, model, cache, vocab: int, width: int = 1, p_sibling: float = 0.0):
        super().__init__(cache, vocab, width, p_sibling)
        self.model = model

    def catch_up_rows(self, span: Span):
        # Positions start .. end-1 as the target wrote them, plus the token just sampled at `end`.
        ids = span.request.all_ids
        return Row(span.request.slot, span.start, ids[span.start:span.end + 1]), None

    def run(self, depth, rows, hidden, at=None):
        batch = ForwardBatch.build(rows)
        out = self.model(batch, self.cache)
        return None, self.model.logits(out if at is None else out[at.to(out.device)])


def check_draft_files(spec: SpecConfig, target: ModelConfig) -> tuple[int, ...]:
    """Header-level checks of the draft, before any weights are read. Returns the compress ratios
    of a detached MTP draft's layers (empty for other drafters)."""
    if spec.runs_mtp:
        header = mtp.read_header(spec.draft_model)
        mtp.check_compatible(header, spec.draft_model, target, "")
        return header.compress_ratios
    if spec.type == "draft-simple":
        files = open_model(spec.draft_model)
        if files.config.vocab_size != target.vocab_size:
            raise ConfigError(f"spec_draft_model={spec.draft_model!r}: vocabulary of {files.config.vocab_size} "
                              f"tokens differs from the target's {target.vocab_size}")
    return ()


def load_drafter(spec: SpecConfig, target_model, target_tensors: dict, dtype: str, slots: int,
                 ctx_per_slot: int, draft_ratios: tuple[int, ...] = (), device: str = "cpu") -> Drafter:
    """The drafter for `spec`, with its own cache where it keeps one, all on `device`. draft_ratios:
    a detached MTP draft's layers' compress ratios, checked with the target's (engine.preflight)."""
    config = target_model.config
    if spec.type == "ngram-simple":
        return NgramDrafter(spec, config.vocab_size)
    if spec.runs_mtp:
        header = mtp.read_header(spec.draft_model)
        fingerprint = mtp.target_fingerprint(config, target_tensors["model.embed_tokens.weight"])
        mtp.check_compatible(header, spec.draft_model, config, fingerprint)
        # The draft only proposes (the target decides every token), and its weights are read once
        # per drafted token: in f32 they cost a quarter of what int8 does, for the same proposals
        # nearly always. So a target computing in f32 (f32, int8, auto) gets an int8 draft, and
        # one in a block format a draft in that format (quantized on load: the file is f32).
        draft_dtype = dtype if dtype in FORMATS else "int8" if compute_dtype(dtype) == torch.float32 else dtype
        specs = [LayerSpec.of(r, config.qsa_budget) for r in draft_ratios or header.compress_ratios]
        # It embeds with the target's table where that sits on its device, else with a copy of its own.
        embed = None if target_model.stages[0].device == torch.device(device) else \
            embedding_table(config, target_tensors, dtype).to(device)
        draft = mtp.MTPDraft(config, mtp.load_tensors(spec.draft_model), specs, draft_dtype, ctx_per_slot, device,
                             embed)
        cache = KVCache(len(specs), slots, ctx_per_slot, config.num_kv_heads, config.head_dim, compute_dtype(dtype),
                        specs=specs, devices=[device] * len(specs))
        drafter = MTPDrafter(draft, target_model, cache, config.vocab_size, spec.width, spec.p_sibling)
        return MTPNgramDrafter(drafter, spec.ngram_n) if spec.type == "draft-mtp-ngram" else drafter
    files = open_model(spec.draft_model)
    c = files.config
    model = Transformer(c, files.load_tensors(keep_blocks=keeps_blocks(dtype)), dtype,
                        max_positions=max(ctx_per_slot, c.max_position_embeddings),
                        placement=Placement.single(c.num_layers, device))
    cache = KVCache(c.num_layers, slots, ctx_per_slot, c.num_kv_heads, c.head_dim, compute_dtype(dtype),
                    specs=model.specs, devices=[device] * c.num_layers)
    return DraftModelDrafter(model, cache, config.vocab_size, spec.width, spec.p_sibling)
