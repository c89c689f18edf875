"""DraftRunner: the engine's one call into speculation after each step.

It hands the drafter the spans the target committed, keeps the drafts it returns on their requests,
and decides when drafting waits: past `max_batch` decoding requests nobody drafts, a request whose
drafting stopped paying at its context pauses (engine.spec.pacing, from the step times the engine
reports through `observe`), and a drafter with a cache of its own is owed the committed spans until
it catches up in one forward. Called only from the engine thread.
"""
from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import Callable

import torch

from engine.sched.request import Request, Status
from engine.spec.drafter import Drafter, Span
from engine.spec.pacing import Pacer

log = logging.getLogger("tandem.engine")
# At this many owed positions the catch-up runs anyway, which bounds the hidden states kept per request.
CATCH_UP_CHUNK = 128


class DraftRunner:
    def __init__(self, drafter: Drafter, max_batch: int, fail: Callable[[Request], None],
                 catch_up_chunk: int = CATCH_UP_CHUNK, pacing: bool = True):
        """max_batch: SpecConfig's (0: no limit). fail: ends a request whose drafting failed.
        pacing: SpecConfig's (False: no request pauses for its gain)."""
        self.drafter, self.max_batch, self.fail = drafter, max_batch, fail
        self.pacer = Pacer() if pacing else None
        self.catch_up_chunk = catch_up_chunk
        # Per request, the committed span its drafter has not caught up on yet, and the slot it lies in.
        self._owed: dict[Request, tuple[int, Span]] = {}
        # Per request, the seconds its current draft took (None: shared with a catch-up or others).
        self._cost: dict[Request, float | None] = {}

    def forget(self, request: Request) -> None:
        """The request ends outside a step (cancelled, failed): whatever it owes is dropped, which
        leaves a gap in the draft's cache under its slot's kept prefix (acceptance, never
        correctness, pays for it)."""
        self._owed.pop(request, None)
        self._cost.pop(request, None)
        if self.pacer is not None:
            self.pacer.forget(request)

    def observe(self, request: Request, context: int, seconds: float | None, drafted: bool, tokens: int) -> None:
        """A decode step of the request from `context` positions: its forward's seconds (None where
        it shared the step), whether it verified a draft, and the tokens it committed."""
        if self.pacer is None:
            return
        if drafted and seconds is not None:
            cost = self._cost.get(request)
            seconds = None if cost is None else seconds + cost
        self.pacer.observe(request, context, seconds, drafted, tokens)

    def after_step(self, spans: list[Span], finished: list[Request]) -> None:
        """Drafts for the next step, batched; when the batch fails, each request drafts alone so
        that only the one that fails loses its stream. spans: the running requests' committed
        spans; finished: the requests this step finished, whose owed spans are caught up now so
        that their slot's prefix serves a next turn with the draft's cache whole (all but the last
        step's span)."""
        busy = bool(self.max_batch) and sum(not s.request.prefilling for s in spans) > self.max_batch
        if self._owed:  # a preempted request's slot was emptied: it resumes from 0 and owes nothing
            self._owed = {req: owed for req, owed in self._owed.items()
                          if req.status is Status.RUNNING or req in finished}
        ready = [self._owed.pop(req)[1] for req in finished if req in self._owed]
        for req in finished:
            self._cost.pop(req, None)
            if self.pacer is not None:
                self.pacer.forget(req)
        alone = len(spans) == 1
        caught_up = set()  # requests whose draft comes with a catch-up: its time is not a draft's
        for span in spans:
            try:
                merged = self._with_owed(span)
                if merged is not span:
                    caught_up.add(span.request)
                paused = self.pacer is not None and not span.request.prefilling and \
                    not self.pacer.wants_draft(span.request, span.end, alone)
                if busy or paused:
                    merged.room = 0
                    if self.drafter.has_cache and merged.end - merged.start < self.catch_up_chunk:
                        # A view of this step's hidden states would keep all of them alive.
                        owed = merged if merged is not span else replace(span, hidden=span.hidden.clone())
                        self._owed[span.request] = span.request.slot, owed
                        continue
            except Exception:  # e.g. out of device memory for the kept states: this request only
                log.exception("request %s failed keeping its draft catch-up", span.request.id)
                self.fail(span.request)
                continue
            ready.append(merged)
        if ready:
            start = time.perf_counter()
            drafts = self._draft(ready)
            seconds = time.perf_counter() - start if len(ready) == 1 else None
            for req, draft in drafts.items():
                req.draft = draft if req.constraint is None else req.constraint.cut(draft)
                self._cost[req] = None if req in caught_up else seconds

    def _draft(self, spans: list[Span]) -> dict:
        try:
            return self.drafter.draft(spans)
        except Exception:
            log.exception("drafting failed for a batch of %d; drafting each alone", len(spans))
        drafts = {}
        for span in spans:
            try:
                drafts.update(self.drafter.draft([span]))
            except Exception:
                log.exception("request %s failed drafting", span.request.id)
                self.fail(span.request)
        return drafts

    def _with_owed(self, span: Span) -> Span:
        """The span, preceded by the positions its request owes the drafter where they lead up to
        it in the same slot (a preempted request resumes by recomputing, and owes nothing before)."""
        slot, owed = self._owed.pop(span.request, (None, None))
        if owed is None or slot != span.request.slot or owed.end != span.start:
            return span
        return replace(span, start=owed.start, hidden=torch.cat([owed.hidden, span.hidden]))
