"""Speculative acceptance: which drafted tokens the target keeps, and the token it adds.

Greedy: drafts are kept while each equals the target's argmax; the target's own token follows at
the first mismatch (or as the bonus token after all k). Sampling: draft x is kept with probability
min(1, p(x)/q(x)); at the first rejection the token is drawn from normalise(max(0, p - q)). This
keeps the output distribution exactly the target's (Leviathan et al., Chen et al. 2023).

Siblings (docs/architecture.md, "Trees"): where the chain's draft at depth d is rejected, its
siblings at depth d are tried in order against what remains. Greedy keeps the one equal to the
argmax. Sampling keeps sibling s with probability r(s), r the distribution the token would
otherwise be drawn from, and on rejection takes s out of r (a one-hot draft's residual); the token
kept is then exactly a draw from r, whichever siblings were proposed, as in SpecInfer's
multi-candidate rule. A kept sibling is followed by the target's token at the sibling's own row.

Grammars (engine.sched.grammar): each row's logits are masked to what the grammar allows after the
row's own path, after penalties and bias, so p is the masked distribution. A draft the grammar cut
keeps the refused token's q: that token had p = 0, so it would have been rejected for certain, and
the residual max(0, p - q) it leaves is what the next token is drawn from, exactly as if it had
been verified.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sched.request import Draft
from engine.sched.sampling import SamplingParams, adjust_logits, constrained, distribution, sample


@dataclass
class Verdict:
    accepted: int  # how many drafts were kept
    tokens: list[int]  # the kept drafts followed by the target's token: accepted + 1 tokens
    # The verify row's index of each position the step commits (its last token, then the kept
    # drafts): 0 .. accepted along the chain; a kept sibling's is its own, past the chain's.
    rows: list[int] | None = None

    def __post_init__(self) -> None:
        if self.rows is None:
            self.rows = list(range(self.accepted + 1))


def _sibling_rows(draft: Draft, depth: int) -> list[tuple[int, int]]:
    """(row, token) of each sibling of the chain's draft at `depth`, in the order they are tried."""
    first = 1 + len(draft.tokens)
    return [(first + i, t) for i, (d, t) in enumerate(draft.siblings) if d == depth]


def accept_greedy(drafts: list[int], target_argmax: list[int], draft: Draft | None = None) -> Verdict:
    """target_argmax[i]: the target's argmax after the i-th verified row (one per row of the
    draft's verify row: the chain's k+1, then its siblings')."""
    n = 0
    while n < len(drafts) and drafts[n] == target_argmax[n]:
        n += 1
    if draft is not None:  # past the chain's end only a cut draft has siblings
        for row, token in _sibling_rows(draft, n):
            if token == target_argmax[n]:
                return Verdict(n + 1, drafts[:n] + [token, target_argmax[row]], list(range(n + 1)) + [row])
    return Verdict(n, drafts[:n] + [target_argmax[n]])


def accept_sampled(drafts: list[int], p, q: torch.Tensor, generator: torch.Generator,
                   draft: Draft | None = None) -> Verdict:
    """p: the target's distribution [vocab] at each verified row (the chain's k+1, then the
    siblings'), as a tensor [rows, vocab] or anything indexed by row: the walk reads only the rows it
    reaches (the chain's up to its first rejection, a kept sibling's), so a lazy p computes no
    other; q: [k, vocab] the draft distributions the chain's drafts were drawn from."""
    k = len(drafts)
    u = torch.rand(k, generator=generator) if k else None
    n = 0
    while n < k and float(u[n]) < float(p[n][drafts[n]] / q[n, drafts[n]]):
        n += 1
    if n == k and not (draft is not None and draft.cut):
        return Verdict(n, drafts + [sample(p[k], generator)])
    rejected = q[n] if n < k else draft.refused_q
    # p == q leaves no residual mass; a rejection then has probability 0, but rounding can still
    # reach here, and p itself is the right distribution then; likewise after a sibling's rejection.
    dist = p[n] if rejected is None else _normalised((p[n] - rejected).clamp(min=0), p[n])
    for row, token in _sibling_rows(draft, n) if draft is not None else ():
        if float(torch.rand(1, generator=generator)) < float(dist[token]):
            return Verdict(n + 1, drafts[:n] + [token, sample(p[row], generator)], list(range(n + 1)) + [row])
        dist = _normalised(dist.index_fill(0, torch.tensor([token]), 0), p[n])
    return Verdict(n, drafts[:n] + [sample(dist, generator)])


def _normalised(mass: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    total = mass.sum()
    return mass / total if total > 0 else fallback


def draft_paths(draft: Draft) -> list[list[int]]:
    """The tokens before each verify row's prediction, after the request's last token: the chain's
    prefixes, then each sibling's path."""
    drafts = draft.tokens
    return [drafts[:i] for i in range(len(drafts) + 1)] + [drafts[:d] + [t] for d, t in draft.siblings]


def verify(draft: Draft, logits: torch.Tensor, params: SamplingParams, history: list[int],
           generator: torch.Generator, constraint=None) -> Verdict:
    """The verdict on a draft that followed `history`, from the target's logits at each verified
    row ([1 + len(draft.row), vocab]). Penalties and bias apply at each row as if the tokens
    before it on its path had been emitted; a grammar's constraint (engine.sched.grammar) then
    removes what each row may not produce after its path."""
    paths = draft_paths(draft)
    if params.greedy:
        adjust = params.has_penalties or params.logit_bias
        rows = [adjust_logits(row, params, history + path) if adjust else row for row, path in zip(logits, paths)]
        argmax = [int(row.argmax()) if constraint is None else constraint.best(row, path)
                  for row, path in zip(rows, paths)]
        return accept_greedy(draft.tokens, argmax, draft)
    return accept_sampled(draft.tokens, _RowDistributions(logits, params, history, paths, constraint), draft.q,
                          generator, draft)


class _RowDistributions:
    """The target's distribution at each verify row, computed when first read: a row's costs a
    softmax and, with top-p, a sort over the vocabulary (about 1 ms here), and a verdict reads only
    the rows its walk reaches."""

    def __init__(self, logits: torch.Tensor, params: SamplingParams, history: list[int], paths: list[list[int]],
                 constraint):
        self.logits, self.params, self.history, self.paths = logits, params, history, paths
        self.constraint = constraint
        self.rows: dict[int, torch.Tensor] = {}

    def __getitem__(self, i: int) -> torch.Tensor:
        if i not in self.rows:
            logits = adjust_logits(self.logits[i], self.params, self.history + self.paths[i])
            mask = None if self.constraint is None else self.constraint.masks([self.paths[i]])[0]
            self.rows[i] = distribution(constrained(logits, mask), self.params)
        return self.rows[i]
