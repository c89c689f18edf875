"""What the engine reports about itself: per-slot snapshots for /slots and counters since start."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.sched.scheduler import Scheduler


@dataclass
class SlotInfo:
    """A snapshot of one slot for /slots (read from any thread)."""
    id: int
    n_ctx: int
    is_processing: bool
    id_task: str | None
    n_prompt_tokens: int
    n_cached: int  # positions whose K/V the slot holds
    n_decoded: int
    draft_n: int  # drafted and accepted tokens of the slot's current request
    draft_n_accepted: int
    # A recurrent model's: the prefix lengths whose state the slot keeps a snapshot of, which a next
    # request sharing them resumes from (None for a model of attention layers alone: any prefix).
    state_snapshots: list[int] | None = None


@dataclass
class EngineStats:
    """Counters since start, written on the engine thread and read anywhere."""
    steps: int = 0  # forward passes
    busy_slots: int = 0  # sum over steps of the slots in the step
    preemptions: int = 0  # requests paused for want of KV room, to resume later
    # Per draft position i (0-based): how often a draft reached it, and how often it was accepted.
    drafted_at: list[int] = field(default_factory=list)
    accepted_at: list[int] = field(default_factory=list)
    siblings_kept: int = 0  # steps whose kept path ended in a sibling rather than the chain's draft

    def count_drafts(self, drafted: int, accepted: int) -> None:
        grow = drafted - len(self.drafted_at)
        if grow > 0:
            self.drafted_at.extend([0] * grow)
            self.accepted_at.extend([0] * grow)
        for i in range(drafted):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < accepted


def slot_infos(scheduler: Scheduler, ctx_per_slot: int, recurrent=None) -> list[SlotInfo]:
    """recurrent: the cache's RecurrentCache, for a recurrent model."""
    out = []
    for slot in scheduler.slots:
        req = slot.request  # one read: the engine thread may swap it meanwhile
        snapshots = None if recurrent is None else sorted(n for n in recurrent.snap_lengths[slot.id] if n > 0)
        out.append(SlotInfo(slot.id, ctx_per_slot, req is not None, req.id if req else None,
                            req.n_prompt if req else 0, len(slot.cached_ids), req.n_output if req else 0,
                            req.draft_n if req else 0, req.draft_n_accepted if req else 0, snapshots))
    return out
