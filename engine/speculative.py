"""Speculative acceptance: which drafted tokens the target keeps, and the token it adds.

Greedy: drafts are kept while each equals the target's argmax; the target's own token follows at
the first mismatch (or as the bonus token after all k). Sampling: draft x is kept with probability
min(1, p(x)/q(x)); at the first rejection the token is drawn from normalise(max(0, p - q)). This
keeps the output distribution exactly the target's (Leviathan et al., Chen et al. 2023).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Verdict:
    accepted: int  # how many drafts were kept
    tokens: list[int]  # the kept drafts followed by the target's token: accepted + 1 tokens


def accept_greedy(drafts: list[int], target_argmax: list[int]) -> Verdict:
    """target_argmax[i]: the target's argmax after the i-th verified position (k+1 entries)."""
    n = 0
    while n < len(drafts) and drafts[n] == target_argmax[n]:
        n += 1
    return Verdict(n, drafts[:n] + [target_argmax[n]])


def accept_sampled(drafts: list[int], p: torch.Tensor, q: torch.Tensor, generator: torch.Generator) -> Verdict:
    """p: [k+1, vocab] target distributions at each verified position; q: [k, vocab] the draft
    distributions the drafts were drawn from."""
    k = len(drafts)
    if k:
        ids = torch.tensor(drafts)
        rows = torch.arange(k)
        ratio = p[rows, ids] / q[rows, ids]
        u = torch.rand(k, generator=generator)
        rejected = torch.nonzero(u >= ratio).flatten()
        n = int(rejected[0]) if rejected.numel() else k
    else:
        n = 0
    if n < k:
        residual = (p[n] - q[n]).clamp(min=0)
        total = residual.sum()
        # p == q leaves no residual mass; a rejection then has probability 0, but rounding can
        # still reach here, and p itself is the right distribution in that case.
        dist = residual / total if total > 0 else p[n]
    else:
        dist = p[k]
    token = int(torch.multinomial(dist, 1, generator=generator))
    return Verdict(n, drafts[:n] + [token])
