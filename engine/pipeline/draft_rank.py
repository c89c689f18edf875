"""The draft on a rank of its own (--spec-draft-rank): the last rank of the torch.distributed group
runs the drafter, and the head asks it for drafts after every step (docs/architecture.md, "The
draft on its own rank").

The head's `RemoteDrafter` stands where the drafter would: it sends each step's spans (slot,
positions, the tokens there, the request's sampling and draft limits, and the target's hidden
states) and receives the drafts. The draft rank keeps each slot's tokens from the spans it is sent,
so a drafter there reads a request (`DraftRequest`) as it would on the head: its slot, its tokens,
whether it is prefilling, its limits and parameters. Spans cover every committed position in order
(spec.runner's catch-up), so those tokens are the request's.

A request goes as a pickled description (small) and the hidden states as a tensor; the drafts come
back in tensors whose shapes the head knows from what it sent (no header, so their receives are
posted with the send: gloo moves a message promptly only into a receive already posted). Each
sampled draft's distributions come back whole ([n_max, vocab] per request that samples). A request
that samples draws its draft with a generator seeded from its own, so a seeded request repeats.
"""
from __future__ import annotations

import contextlib
import logging
import pickle
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.files.nearest_format import stored_formats
from engine.ops.quant import compute_dtype, keeps_blocks, resolve_activations, use_activations
from engine.pipeline.ranks import join
from engine.pipeline.transport import HEARTBEAT_S, LinkError, Op, Pending
from engine.sched.request import Draft, Request
from engine.sched.sampling import SamplingParams
from engine.settings import DraftLimits, SpecConfig
from engine.spec.drafter import Span
from engine.spec.loading import load_drafter

log = logging.getLogger("tandem.pipeline")

DRAFT_HEADER_TAG, DRAFT_PAYLOAD_TAG, DRAFT_REPLY_TAG = 3, 4, 5
# A draft rank that hears nothing for this long (the head heartbeats every HEARTBEAT_S when idle)
# takes the head for lost.
IDLE_TIMEOUT_S = 9.0


@dataclass
class SpanMeta:
    """One span as the draft rank needs it: positions start .. end-1 of `slot` committed; `tokens`
    the request's tokens `since` .. end (the last, when decoding, is the one just sampled), since
    at most start: from where the rank's copy of the slot's tokens may differ."""
    slot: int
    start: int
    end: int
    room: int
    since: int
    tokens: list[int]
    prefilling: bool
    params: SamplingParams
    limits: DraftLimits
    seed: int | None  # a sampling request's draft generator's seed


@dataclass(eq=False)
class DraftRequest:
    """What a drafter reads of a request, on the draft rank."""
    slot: int
    token_ids: list[int]
    prefilling: bool
    params: SamplingParams
    draft_limits: DraftLimits
    generator: torch.Generator | None


def reply_shapes(n: int, spec: SpecConfig, vocab: int, sampling: bool) -> tuple[tuple[int, ...], tuple[int, ...] | None]:
    """The shapes of the drafts for n spans: int64 [n, 3 + n_max + 2 * siblings] (whether a draft
    came, its token count, its sibling count, the tokens, then (depth, token) pairs), and the f32
    distributions [n, n_max, vocab] when any of them samples."""
    siblings = spec.n_max * (spec.width - 1)
    return (n, 3 + spec.n_max + 2 * siblings), ((n, spec.n_max, vocab) if sampling else None)


class DraftLink:
    """One end of the head <-> draft rank exchange, beside the trunk's ring, on tags of its own."""

    def __init__(self, peer: int, hidden_size: int, dtype: torch.dtype):
        self.peer, self.hidden_size, self.dtype = peer, hidden_size, dtype

    def send(self, op: Op, meta=None, hidden: torch.Tensor | None = None, timeout: float = 8.0) -> Pending:
        body = torch.frombuffer(bytearray(pickle.dumps(meta)), dtype=torch.uint8) if meta is not None else None
        header = torch.tensor([op, 0 if body is None else len(body), 0 if hidden is None else hidden.shape[0]])
        parts = [(header, DRAFT_HEADER_TAG)] + [(t, DRAFT_PAYLOAD_TAG) for t in (body, hidden) if t is not None]
        return self._post(dist.isend, [(t.cpu().contiguous(), tag) for t, tag in parts], timeout)

    def recv(self, timeout: float):
        """(op, meta, hidden): the next request from the peer."""
        header = torch.empty(3, dtype=torch.long)
        self._post(dist.irecv, [(header, DRAFT_HEADER_TAG)], timeout).wait()
        op, size, rows = header.tolist()
        body = torch.empty(size, dtype=torch.uint8) if size else None
        hidden = torch.empty(rows, self.hidden_size, dtype=self.dtype) if rows else None
        self._post(dist.irecv, [(t, DRAFT_PAYLOAD_TAG) for t in (body, hidden) if t is not None], timeout).wait()
        meta = pickle.loads(body.numpy().tobytes()) if body is not None else None
        return Op(op), meta, hidden

    def post(self, send: bool, tensors: list[torch.Tensor], timeout: float) -> Pending:
        """Sends or receives of reply tensors, whose shapes both ends know."""
        return self._post(dist.isend if send else dist.irecv, [(t, DRAFT_REPLY_TAG) for t in tensors], timeout)

    def _post(self, op, parts: list[tuple[torch.Tensor, int]], timeout: float) -> Pending:
        try:
            works = [op(t, self.peer, tag=tag) for t, tag in parts]
        except RuntimeError as e:
            raise LinkError.of(self.peer, e) from e
        return Pending(works, [t for t, _ in parts], timeout, self.peer)


class RemoteDrafter:
    """The head's drafter when the draft runs on its own rank: each step's spans out, drafts back.
    Once the rank is lost (the failure is logged, naming it), requests decode without drafts:
    speculation only ever saves time, so losing it loses no request."""
    has_cache = True

    def __init__(self, link: DraftLink, spec: SpecConfig, vocab: int, timeout: float, name_failure):
        """name_failure(rank, error): a better account of the lost rank when the head knows one."""
        self.link, self.spec, self.vocab, self.timeout, self.name_failure = link, spec, vocab, timeout, name_failure
        self.needs_hidden = spec.runs_mtp
        self.failure: str | None = None
        self._last_sent = time.monotonic()
        self._sent: dict[int, int] = {}  # per slot, how many of its tokens the draft rank holds

    def resident(self) -> None:
        return None  # nothing of the draft is held here

    def draft(self, spans: list[Span]) -> dict[Request, Draft]:
        if self.failure is not None:
            return {}
        metas = []
        for s in spans:
            # A span the runner never sent (a cancelled request's owed one) leaves the rank's copy
            # short of a prefix the next request reuses: it gets the tokens from where it stops.
            since = min(s.start, self._sent.get(s.request.slot, 0))
            self._sent[s.request.slot] = s.end + 1
            seed = None if s.request.params.greedy else int(torch.randint(2**62, (1,), generator=s.request.generator))
            metas.append(SpanMeta(s.request.slot, s.start, s.end, s.room, since, s.request.token_ids[since:s.end + 1],
                                  s.request.prefilling, s.request.params, s.request.draft_limits, seed))
        hidden = torch.cat([s.hidden for s in spans]) if self.needs_hidden else None
        ints, qs = reply_shapes(len(spans), self.spec, self.vocab, any(m.seed is not None for m in metas))
        replies = [torch.empty(ints, dtype=torch.long)] + ([torch.empty(qs)] if qs else [])
        with self._guard():
            sent = self.link.send(Op.FORWARD, metas, hidden, self.timeout)
            got = self.link.post(False, replies, self.timeout)
            sent.wait()
            got.wait()
        if self.failure is not None:
            return {}
        return unpack(spans, self.spec.n_max, *replies)

    def keepalive(self) -> None:
        """A heartbeat when the draft rank has heard nothing for a while (the engine calls this idle)."""
        if self.failure is None and time.monotonic() - self._last_sent >= HEARTBEAT_S:
            with self._guard():
                self.link.send(Op.HEARTBEAT, timeout=self.timeout).wait()

    def close(self) -> None:
        if self.failure is None:
            try:
                self.link.send(Op.STOP, timeout=min(self.timeout, 2.0)).wait()
            except LinkError:
                pass

    @contextlib.contextmanager
    def _guard(self):
        try:
            yield
        except LinkError as e:
            self.failure = self.name_failure(e.rank, e) or f"the draft (rank {e.rank}) lost: {e}"
            log.error("%s; requests go on without drafts", self.failure)
        self._last_sent = time.monotonic()


def pack(metas: list[SpanMeta], requests: list[DraftRequest], drafts: dict, spec: SpecConfig,
         vocab: int) -> list[torch.Tensor]:
    """The drafts for the spans, in reply_shapes' tensors."""
    ints_shape, qs_shape = reply_shapes(len(metas), spec, vocab, any(m.seed is not None for m in metas))
    ints = torch.zeros(ints_shape, dtype=torch.long)
    qs = torch.zeros(qs_shape) if qs_shape else None
    for i, req in enumerate(requests):
        draft = drafts.get(req)
        if draft is None:
            continue
        n, pairs = len(draft.tokens), [v for pair in draft.siblings for v in pair]
        ints[i, :3] = torch.tensor([1, n, len(draft.siblings)])
        ints[i, 3:3 + n] = torch.tensor(draft.tokens, dtype=torch.long)
        ints[i, 3 + spec.n_max:3 + spec.n_max + len(pairs)] = torch.tensor(pairs, dtype=torch.long)
        if draft.q is not None:
            qs[i, :n] = draft.q
    return [ints] + ([qs] if qs is not None else [])


def unpack(spans: list[Span], n_max: int, ints: torch.Tensor, qs: torch.Tensor | None = None) -> dict[Request, Draft]:
    """pack's tensors back into the spans' requests' drafts."""
    drafts = {}
    for i, (span, row) in enumerate(zip(spans, ints.tolist())):
        came, n, siblings = row[:3]
        if not came:
            continue
        pairs = row[3 + n_max:3 + n_max + 2 * siblings]
        q = None if qs is None or span.request.params.greedy else qs[i, :n].clone()
        drafts[span.request] = Draft(row[3:3 + n], q, list(zip(pairs[::2], pairs[1::2])))
    return drafts


def serve_drafts(drafter, link: DraftLink, spec: SpecConfig, vocab: int, slots: int, timeout: float) -> None:
    """The draft rank's loop, until the head says stop: each step's spans drafted and answered.
    Raises LinkError when the head is lost or silent too long."""
    requests = [DraftRequest(s, [], False, SamplingParams(), DraftLimits(0, 0, 0.0), None) for s in range(slots)]
    while True:
        op, metas, hidden = link.recv(max(IDLE_TIMEOUT_S, timeout))
        if op is Op.STOP:
            return
        if op is not Op.FORWARD:
            continue
        spans, offset, asked = [], 0, []
        for meta in metas:
            req = requests[meta.slot]
            del req.token_ids[meta.since:]
            req.token_ids.extend(meta.tokens)
            req.prefilling, req.params, req.draft_limits = meta.prefilling, meta.params, meta.limits
            req.generator = None if meta.seed is None else torch.Generator().manual_seed(meta.seed)
            rows = meta.end - meta.start
            spans.append(Span(req, meta.start, meta.end, hidden[offset:offset + rows] if hidden is not None else None,
                              meta.room))
            offset += rows
            asked.append(req)
        try:
            drafts = drafter.draft(spans)
        except Exception:  # this step drafts nothing; the next spans still come
            log.exception("drafting failed for a batch of %d", len(spans))
            drafts = {}
        link.post(True, pack(metas, asked, drafts, spec, vocab), timeout).wait()


def draft_main(config, headers, rank) -> int:
    """The draft rank's life: load the draft (and the target's embedding it reads), meet the other
    ranks, draft until the head stops it or is lost. Returns the exit status."""
    if config.threads:
        torch.set_num_threads(config.threads)
    mc, placement = headers.model, headers.placement
    tensors = headers.files.load_tensors(range(0), keep_blocks=keeps_blocks(config.dtype))
    drafter = load_drafter(config.spec, headers.draft, mc, tensors, config.dtype, config.parallel,
                           config.ctx_per_slot, headers.draft_ratios, placement.draft_device)
    del tensors
    if drafter.resident() is not None:
        use_activations(drafter.resident()[0], resolve_activations(config.activations, config.dtype,
                                                                    stored_formats(headers.files)))
    log.info("the draft (rank %d of %d): %s on %s loaded", rank.rank, rank.world, config.spec.type,
             placement.draft_device)
    join(rank, placement)
    link = DraftLink(0, mc.residual_width, compute_dtype(config.dtype))
    try:
        serve_drafts(drafter, link, config.spec, mc.vocab_size, config.parallel, config.pipeline_timeout)
    except LinkError as e:
        log.error("the draft: lost the head (%s); exiting", e)
        return 1
    log.info("the draft: stopped by the head")
    return 0
