"""Speculative acceptance: which drafted tokens the target keeps, and the token it adds.

Greedy: drafts are kept while each equals the target's argmax; the target's own token follows at
the first mismatch (or as the bonus token after all k). Sampling: draft x is kept with probability
min(1, p(x)/q(x)); at the first rejection the token is drawn from normalise(max(0, p - q)). This
keeps the output distribution exactly the target's (Leviathan et al., Chen et al. 2023).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import Draft
from engine.sampling import SamplingParams, adjust_logits, distribution, sample


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
    return Verdict(n, drafts[:n] + [sample(dist, generator)])


def verify(draft: Draft, logits: torch.Tensor, params: SamplingParams, history: list[int],
           generator: torch.Generator) -> Verdict:
    """The verdict on a draft that followed `history`, from the target's logits at each verified
    position ([1 + len(draft.tokens), vocab]). Penalties and bias apply at each position as if the
    drafts before it had been emitted."""
    drafts = draft.tokens
    if params.greedy:
        argmax = [int(adjust_logits(row, params, history + drafts[:i]).argmax()) if params.has_penalties
                  or params.logit_bias else int(row.argmax()) for i, row in enumerate(logits)]
        return accept_greedy(drafts, argmax)
    p = torch.stack([distribution(adjust_logits(row, params, history + drafts[:i]), params)
                     for i, row in enumerate(logits)])
    return accept_sampled(drafts, p, draft.q if drafts else p[:0], generator)
