"""The training objective: the loss of one sequence at depth 1 and (weighted) depth 2, hard labels
and optionally the target's own distribution over the head's subset."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.model.batch import causal_mask
from train.data import Sequence
from train.draft import run_row

# Training pads each sequence's length to a multiple of PAD: oneDNN builds a kernel for every
# matrix shape and keeps about a thousand, so with every length its own shape a step kept paying
# for kernel builds (8 sequences: 0.49-0.52 s a step unpadded, 0.31 s padded).
PAD = 64


@dataclass
class Objective:
    to_subset: torch.Tensor  # [vocab] subset index of each full-vocabulary id, -1 outside
    teacher: torch.Tensor  # [K, H] the target's own lm_head rows of the subset (frozen)
    depth2: float  # weight of the depth-2 terms
    soft: float  # share of the soft term: cross-entropy to the target's distribution over the subset

    @classmethod
    def for_draft(cls, draft, depth2: float, soft: float) -> "Objective":
        to_subset = torch.full((draft.config.vocab_size,), -1, dtype=torch.long)
        to_subset[draft.vocab_ids] = torch.arange(len(draft.vocab_ids))
        return cls(to_subset, draft.head.weight.detach().clone(), depth2, soft)


def padded(seq: Sequence, multiple: int) -> Sequence:
    """`seq` with unlabeled positions appended up to a multiple of `multiple`; attention is causal,
    so they change nothing before them."""
    extra = -len(seq.next_ids) % multiple
    return Sequence(F.pad(seq.hidden, (0, 0, 0, extra)), F.pad(seq.next_ids, (0, extra)),
                    F.pad(seq.labels, (0, extra), value=-1))


def sequence_loss(draft, embed, seq: Sequence, obj: Objective) -> tuple[torch.Tensor, int, int]:
    """Summed loss of one sequence at depth 1 and (weighted) depth 2, with labeled positions and
    depth-1 hits. Autograd cannot go through one KVCache shared by several rows (a row's write
    bumps the version of the storage another row's attention saved), so each sequence gets its own."""
    seq = padded(seq, PAD)
    n = len(seq.next_ids)
    hidden, emb, target = seq.hidden, embed(seq.next_ids), obj.to_subset[seq.labels.clamp(min=0)]
    target[seq.labels < 0] = -1
    positions = mask = None
    if obj.depth2:
        # Depth 2 at position j+1 takes depth 1's block output at j and the token depth 1 should have
        # drafted there; its keys are depth 1's at positions <= j and its own, as in serving.
        with torch.no_grad():
            x1, _ = run_row(draft, hidden, emb)
        drafted = torch.where(seq.labels[:-1] >= 0, seq.labels[:-1], seq.next_ids[1:])
        hidden, emb = torch.cat([hidden, x1[:-1]]), torch.cat([emb, embed(drafted)])
        positions = torch.cat([torch.arange(n), torch.arange(1, n)])
        mask = torch.zeros(2 * n - 1, 2 * n - 1, dtype=torch.bool)
        mask[:n, :n] = causal_mask(0, n)
        mask[n:, :n - 1] = causal_mask(0, n - 1)
        mask[n:, n:] = torch.eye(n - 1, dtype=torch.bool)
    _, logits = run_row(draft, hidden, emb, positions, mask)
    # The target's logits at i+1 (its distribution for x_{i+2}); a labeled position always has i+1 < n.
    teacher = F.linear(torch.cat([seq.hidden[1:], seq.hidden[:1]]), obj.teacher) if obj.soft else None

    def term(logits: torch.Tensor, target: torch.Tensor, shift: int) -> torch.Tensor:
        hard = F.cross_entropy(logits, target, ignore_index=-1, reduction="sum")
        if not obj.soft:
            return hard
        known = seq.labels[shift:shift + len(logits)] >= 0
        soft = -(teacher[shift:shift + len(logits)][known].softmax(-1) * logits[known].log_softmax(-1)).sum()
        return (1 - obj.soft) * hard + obj.soft * soft

    loss = term(logits[:n], target, 0)
    if obj.depth2:
        loss = loss + obj.depth2 * term(logits[n:], target[1:], 1)
    hits = int(((logits[:n].argmax(-1) == target) & (target >= 0)).sum())
    return loss, int((target >= 0).sum()), hits
