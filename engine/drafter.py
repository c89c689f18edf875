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
from dataclasses import dataclass
from typing import Protocol

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
from engine.request import Draft, Request
from engine.sampling import distribution
from engine.weights import open_model


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings, llama-server's names. A draft-mtp draft_model of "default"
    becomes the path of the draft the engine ships (mtp.DEFAULT_DRAFT), so everything downstream
    (its checks, /props, the footprint) sees the file."""
    type: str  # canonical: draft-mtp, ngram-simple or draft-simple
    draft_model: str | None = None
    n_max: int = 3
    n_min: int = 0
    p_min: float = 0.5
    ngram_n: int = 3

    def __post_init__(self) -> None:
        if self.type == "draft-mtp" and self.draft_model == "default":
            object.__setattr__(self, "draft_model", str(mtp.DEFAULT_DRAFT))
        check_rules([
            (self.type in SPEC_TYPES.values(), "spec_type", self.type, f"must be one of {', '.join(SPEC_TYPES)}"),
            (self.n_max >= 1, "spec_draft_n_max", self.n_max, "must be >= 1"),
            (0 <= self.n_min <= self.n_max, "spec_draft_n_min", self.n_min,
             f"must be in 0..spec_draft_n_max={self.n_max}"),
            (0 <= self.p_min <= 1 and not math.isnan(self.p_min), "spec_draft_p_min", self.p_min, "must be in [0, 1]"),
            (self.ngram_n >= 1, "spec_ngram_size_n", self.ngram_n, "must be >= 1"),
            (self.type == "ngram-simple" or self.draft_model, "spec_draft_model", self.draft_model,
             f"is required with spec_type={self.type}"),
        ])


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

    def draft(self, spans: list[Span]) -> dict[Request, Draft]: ...


def _choose_drafts(logits: torch.Tensor, reqs: list[Request], vocab_ids: torch.Tensor | None, vocab: int):
    """A draft token from each row of drafter logits [R, V'] (over `vocab_ids` when given), for
    reqs[r]: (token, its top-1 probability, and when the request samples the full-vocabulary
    distribution the token came from)."""
    top, best = torch.softmax(logits, -1).max(-1)  # one pass for the whole batch, greedy or not
    ids = (vocab_ids[best] if vocab_ids is not None else best).tolist()
    out = []
    for row, req, token, p in zip(logits, reqs, ids, top.tolist()):
        if req.params.greedy:
            out.append((token, p, None))
            continue
        full = row if vocab_ids is None else torch.full((vocab,), -math.inf).index_copy_(0, vocab_ids, row)
        q = distribution(full, req.params)
        out.append((int(torch.multinomial(q, 1, generator=req.generator)), p, q))
    return out


def _as_draft(tokens: list[int], qs: list, n_min: int) -> Draft:
    if len(tokens) < n_min:
        return Draft()
    return Draft(tokens, torch.stack(qs) if qs and qs[0] is not None else None)


class NgramDrafter:
    needs_hidden = False

    def __init__(self, spec: SpecConfig, vocab: int):
        self.spec, self.vocab = spec, vocab

    def draft(self, spans: list[Span]) -> dict[Request, Draft]:
        drafts = {}
        for span in spans:
            req = span.request
            if req.prefilling:
                continue
            tokens = ngram_draft(req.all_ids, self.spec.ngram_n, min(self.spec.n_max, span.room))
            # A deterministic draft is a one-hot q: the acceptance rule then keeps it with p(x).
            qs = [torch.nn.functional.one_hot(torch.tensor(t), self.vocab).float() for t in tokens] \
                if not req.params.greedy else [None] * len(tokens)
            drafts[req] = _as_draft(tokens, qs, self.spec.n_min)
        return drafts


class CachedDrafter(ABC):
    """Shared loop of the drafters that run a model with their own KV cache: catch up on the
    committed span, then draft one token per forward, batched across requests."""
    needs_hidden: bool
    vocab_ids: torch.Tensor | None = None  # full-vocabulary id of each logit, when over a subset

    def __init__(self, spec: SpecConfig, cache, vocab: int):
        self.spec, self.cache, self.vocab = spec, cache, vocab

    @abstractmethod
    def catch_up_rows(self, span: Span) -> tuple[Row, torch.Tensor | None]:
        """The drafter's rows for a committed span, and the hidden states they take (or None)."""

    @abstractmethod
    def run(self, depth: int, rows: list[Row], hidden: torch.Tensor | None) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Forward of `rows`; returns (per-token state for the next depth, logits [N, V'])."""

    @torch.inference_mode()
    def draft(self, spans: list[Span]) -> dict[Request, Draft]:
        if not spans:
            return {}
        rows, hiddens = zip(*(self.catch_up_rows(s) for s in spans))
        hidden = torch.cat(hiddens) if hiddens[0] is not None else None
        state, logits = self.run(1, list(rows), hidden)
        ends = itertools.accumulate(len(row.tokens) for row in rows)
        active = []  # (request, tokens, qs, limit, position of the next draft row, its logits row)
        for span, row, end in zip(spans, rows, ends):
            req = span.request
            if req.prefilling:
                continue
            limit = min(self.spec.n_max, span.room)
            active.append([req, [], [], limit, row.start + len(row.tokens), end - 1])
        # Each depth drafts for the requests still going: a request leaves when its draft is as
        # long as its limit or the draft's confidence falls below p_min.
        going, depth = [item for item in active if item[3] > 0], 1
        while going:
            rows_at = torch.tensor([item[5] for item in going])
            choices = _choose_drafts(logits[rows_at], [item[0] for item in going], self.vocab_ids, self.vocab)
            still = []
            for item, (token, top, q) in zip(going, choices):
                if top < self.spec.p_min:
                    continue
                item[1].append(token)
                item[2].append(q)
                if len(item[1]) < item[3]:
                    still.append(item)
            if not still:
                break
            depth += 1
            rows = [Row(item[0].slot, item[4] + depth - 2, [item[1][-1]]) for item in still]
            prev = state[torch.tensor([item[5] for item in still])] if state is not None else None
            state, logits = self.run(depth, rows, prev)
            for j, item in enumerate(still):
                item[5] = j
            going = still
        return {req: _as_draft(tokens, qs, self.spec.n_min) for req, tokens, qs, *_ in active}


class MTPDrafter(CachedDrafter):
    """The detached MTP draft: position i of its cache holds (target hidden h_i, token x_{i+1})."""
    needs_hidden = True

    def __init__(self, spec: SpecConfig, draft, target, cache, vocab: int):
        super().__init__(spec, cache, vocab)
        self.model, self.target = draft, target
        self.vocab_ids = draft.vocab_ids
        self.embed_tokens = target.embed_tokens if draft.embed is None else draft.embed_tokens

    def catch_up_rows(self, span: Span):
        ids = span.request.all_ids
        return Row(span.request.slot, span.start, ids[span.start + 1:span.end + 1]), span.hidden

    def run(self, depth, rows, hidden):
        batch = ForwardBatch.build(rows)
        embeddings = self.embed_tokens(batch.token_ids)
        return self.model(depth, hidden.to(embeddings.dtype), embeddings, batch, self.cache)


class DraftModelDrafter(CachedDrafter):
    """A smaller model with the same vocabulary, run autoregressively on its own cache."""
    needs_hidden = False

    def __init__(self, spec: SpecConfig, model, cache, vocab: int):
        super().__init__(spec, cache, vocab)
        self.model = model

    def catch_up_rows(self, span: Span):
        # Positions start .. end-1 as the target wrote them, plus the token just sampled at `end`.
        ids = span.request.all_ids
        return Row(span.request.slot, span.start, ids[span.start:span.end + 1]), None

    def run(self, depth, rows, hidden):
        batch = ForwardBatch.build(rows)
        out = self.model(batch, self.cache)
        return None, self.model.logits(out)


def check_draft_files(spec: SpecConfig, target: ModelConfig) -> tuple[int, ...]:
    """Header-level checks of the draft, before any weights are read. Returns the compress ratios
    of a detached MTP draft's layers (empty for other drafters)."""
    if spec.type == "draft-mtp":
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
    if spec.type == "draft-mtp":
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
        return MTPDrafter(spec, draft, target_model, cache, config.vocab_size)
    files = open_model(spec.draft_model)
    c = files.config
    model = Transformer(c, files.load_tensors(keep_blocks=keeps_blocks(dtype)), dtype,
                        max_positions=max(ctx_per_slot, c.max_position_embeddings),
                        placement=Placement.single(c.num_layers, device))
    cache = KVCache(c.num_layers, slots, ctx_per_slot, c.num_kv_heads, c.head_dim, compute_dtype(dtype),
                    specs=model.specs, devices=[device] * c.num_layers)
    return DraftModelDrafter(spec, model, cache, config.vocab_size)
