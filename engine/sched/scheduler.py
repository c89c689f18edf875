"""Scheduler: the waiting queue, the slots, prefix reuse, and the plan of each engine step.

It decides and never runs a model: `plan()` returns the rows of the next forward as data.
Called only from the engine thread.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from engine.model.batch import Row
from engine.model.kv_cache import KVCache, PagedKVCache
from engine.sched.request import Request


@dataclass
class Slot:
    id: int
    cached_ids: list[int]  # tokens whose K/V the slot holds, position by position
    request: Request | None = None
    # The target's hidden states at the positions the last step committed, [n, H], the last at the
    # last cached position, kept where a recurrent model's snapshot will keep one of them
    # (Scheduler.keep_hidden): a drafter pairs it with the next token.
    hidden: torch.Tensor | None = None

    def hidden_at(self, position: int) -> torch.Tensor | None:
        """The hidden state kept at `position`, None where the last step did not commit it."""
        first = len(self.cached_ids) - (len(self.hidden) if self.hidden is not None else 0)
        return self.hidden[position - first] if self.hidden is not None and first <= position else None


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


@dataclass
class PlannedRow:
    request: Request
    row: Row
    samples: bool  # whether this row's last token yields a token to sample
    decodes: bool = False  # the request's last token plus its drafts (else a prompt chunk)

    @property
    def num_logits(self) -> int:
        """Positions whose logits the step needs: each of a decode row verifies a draft (or gives
        the next token); a prompt chunk needs its last one only when it ends the prompt."""
        return len(self.row.tokens) if self.decodes else int(self.samples)


@dataclass
class StepPlan:
    rows: list[PlannedRow]
    preempted: list[Request]  # paused because the shared KV pool ran out: back at the queue's head


class Scheduler:
    def __init__(self, num_slots: int, ctx_per_slot: int, batch_size: int, ubatch_size: int,
                 kv: KVCache | PagedKVCache | None = None, reuse_margin: int = 0, draft_max: int = 0,
                 keep_hidden: bool = False):
        self.slots = [Slot(i, []) for i in range(num_slots)]
        self.waiting: deque[Request] = deque()
        self.ctx_per_slot = ctx_per_slot
        self.batch_size = batch_size
        self.ubatch_size = ubatch_size
        # Room for positions: slots own theirs, or share one pool (then `ensure` can fail).
        self.kv = kv if kv is not None else KVCache(0, num_slots, ctx_per_slot, 0, 0)
        # Positions of a reused prefix to recompute anyway: an MTP draft's cache entry at position
        # i pairs h_i with token i+1, so the last reused entry is stale unless h_i is recomputed.
        self.reuse_margin = reuse_margin
        self.draft_max = draft_max  # the most drafts a decode row verifies: room a resumed request needs
        # A recurrent model's drafter that pairs hidden states with next tokens (MTP): its snapshots
        # keep the target's hidden state at their last position, and a request resumes only from one
        # that did, handed to it as `resume_hidden` (instead of a reuse margin: a recurrent state
        # cannot step back one position).
        self.keep_hidden = keep_hidden

    @property
    def running(self) -> list[Request]:
        return [s.request for s in self.slots if s.request is not None]

    def has_work(self) -> bool:
        return bool(self.waiting) or any(s.request is not None for s in self.slots)

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def _pick_slot(self, request: Request, free: list[Slot]) -> Slot | None:
        if request.pinned_slot is not None:
            free = [s for s in free if s.id == request.pinned_slot]
        if not free:
            return None
        if not request.cache_prompt:
            return min(free, key=lambda s: len(s.cached_ids))
        # The free slot holding the longest prefix of this prompt, as llama-server's slot similarity;
        # with no prefix to reuse, the one holding least, so other slots' prefixes survive.
        return max(free, key=lambda s: (common_prefix(s.cached_ids, request.prefill_ids), -len(s.cached_ids)))

    def _admit(self, now: float) -> None:
        """FIFO into free slots. A request pinned to a busy slot waits without holding back those
        behind it; a preempted request at the head waits until its whole length fits again, and
        holds back the rest so that they cannot take the room it needs."""
        free = [s for s in self.slots if s.request is None]
        for request in list(self.waiting):
            if not free:
                return
            slot = self._pick_slot(request, free)
            if slot is None:
                continue
            if request.dropped_n and not self._room_to_resume(request, slot):
                return
            self.waiting.remove(request)
            free.remove(slot)
            reuse = common_prefix(slot.cached_ids, request.prefill_ids) if request.cache_prompt else 0
            # At least the last prompt token runs through the model: its logits give the first token.
            reuse = max(0, min(reuse, len(request.prefill_ids) - 1) - self.reuse_margin)
            reuse = self.kv.reusable(slot.id, reuse, self.keep_hidden)  # a recurrent model: where it holds the state
            request.resume_hidden = self.kv.snapshot_hidden(slot.id, reuse) if self.keep_hidden and reuse else None
            self._trim(slot, reuse)
            slot.request = request
            request.admit(slot.id, reuse, now)

    def _room_to_resume(self, request: Request, slot: Slot) -> bool:
        """Reserve the pool for the request's length plus a full draft, evicting idle slots'
        prefixes if need be (a resumed request must not be preempted again at once)."""
        length = min(len(request.token_ids) + self.draft_max, self.ctx_per_slot)
        return self.kv.ensure(slot.id, length) or (self._evict_idle(keep=slot) and self.kv.ensure(slot.id, length))

    def _evict_idle(self, keep: Slot | None = None) -> bool:
        """Empty idle slots' cached prefixes (all but `keep`'s) so a shared pool gets their room;
        whether any held one."""
        idle = [s for s in self.slots if s.request is None and s.cached_ids and s is not keep]
        for slot in idle:
            self._trim(slot, 0)
        return bool(idle)

    def plan(self, now: float) -> StepPlan:
        """Rows of the next forward: one decode token for every generating request, then prompt
        chunks of at most ubatch tokens, while the step holds at most batch_size tokens."""
        self._admit(now)
        plan, budget = StepPlan([], []), self.batch_size
        for req in self.running:
            if req in plan.preempted:
                continue
            if not req.prefilling and self._reserve(plan, req, req.num_computed + 1 + len(req.draft.row)):
                # The last sampled token, then the drafts to verify after it (a sibling's K/V is
                # written past the chain's, and moved down if it is kept).
                tokens = [req.last_token] + req.draft.row
                plan.rows.append(PlannedRow(req, Row(req.slot, req.num_computed, tokens, req.draft.depths), True,
                                            decodes=True))
                budget -= len(tokens)
        for req in self.running:
            if req.prefilling and budget > 0 and req not in plan.preempted:
                pending = req.prefill_ids
                n = min(self.ubatch_size, budget, len(pending) - req.num_computed)
                if not self._reserve(plan, req, req.num_computed + n):
                    continue
                tokens = pending[req.num_computed:req.num_computed + n]
                # A fresh prompt's last token gives the first output token; a resumed request
                # already has its next token and decodes it next step.
                samples = req.num_computed + n == len(pending) and not req.n_output
                plan.rows.append(PlannedRow(req, Row(req.slot, req.num_computed, tokens), samples))
                budget -= n
        return plan

    def _reserve(self, plan: StepPlan, req: Request, length: int) -> bool:
        """Room for `length` positions in the request's slot. When a shared pool is short, idle
        slots' cached prefixes go first, then the youngest running request (maybe `req` itself) is
        preempted. Each request fits the pool alone (the server checks prompt plus max_tokens), so
        the oldest always makes progress."""
        while not self.kv.ensure(req.slot, length):
            if self._evict_idle():
                continue
            victim = max(self.running, key=lambda r: (r.t_started, r.t_submitted))
            plan.preempted.append(victim)
            plan.rows = [p for p in plan.rows if p.request is not victim]
            self._preempt(victim)
            if victim is req:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Pause a running request: its slot and positions go, its tokens, sampler state and
        counters stay; it waits at the head of the queue to recompute its prefix."""
        slot = self.slots[request.slot]
        slot.request = None
        self._trim(slot, 0)
        request.preempt()
        self.waiting.appendleft(request)

    def _trim(self, slot: Slot, length: int) -> None:
        """Keep the first `length` cached positions of the slot, in the bookkeeping and the cache."""
        del slot.cached_ids[length:]
        self.kv.truncate(slot.id, length)

    def commit(self, request: Request, tokens: list[int], hidden: torch.Tensor | None = None) -> None:
        """Record that `tokens` were written to the request's slot at num_computed onwards; hidden
        [len(tokens), H]: the target's hidden states there (kept with keep_hidden). Where they end
        the prompt, a recurrent model's state there is kept for a next request sharing the prompt."""
        slot = self.slots[request.slot]
        prefilling = request.prefilling
        del slot.cached_ids[request.num_computed:]
        slot.cached_ids.extend(tokens)
        request.commit(len(tokens))
        slot.hidden = hidden if self.keep_hidden else None
        if prefilling and not request.prefilling:
            self._checkpoint(slot, request.num_computed)

    def release(self, request: Request) -> None:
        """Free the request's slot (its cache stays for prefix reuse; a recurrent model keeps its
        state where the request's tokens end, which a next turn's prompt repeats) or drop it from the queue."""
        if request.slot is not None and self.slots[request.slot].request is request:
            slot = self.slots[request.slot]
            slot.request = None
            # Its last token was emitted, not computed; verified drafts past a stop were computed, not emitted.
            self._checkpoint(slot, min(len(slot.cached_ids), len(request.token_ids) - 1))
        elif request in self.waiting:
            self.waiting.remove(request)

    def _checkpoint(self, slot: Slot, length: int) -> None:
        self.kv.checkpoint(slot.id, length, slot.hidden_at(length - 1) if self.keep_hidden else None)
