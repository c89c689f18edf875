"""The acceptance rule keeps the target's distribution exactly, and greedy acceptance stops at the
first mismatch."""
from __future__ import annotations

import torch
from scipy.stats import chisquare

from engine.speculative import accept_greedy, accept_sampled

DRAWS = 50_000


def test_greedy_keeps_drafts_up_to_the_first_mismatch_then_adds_the_target_token():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]).tokens == [5, 6, 9]
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]).accepted == 2
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1]).tokens == [5, 6, 7, 1]
    assert accept_greedy([5, 6, 7], [4, 6, 7, 1]).tokens == [4]
    assert accept_greedy([], [3]).tokens == [3]


def first_tokens(p: torch.Tensor, q: torch.Tensor, seed: int) -> torch.Tensor:
    """Draw a draft from q, run the acceptance rule against p, and record the first emitted token."""
    g = torch.Generator().manual_seed(seed)
    drafts = torch.multinomial(q, DRAWS, replacement=True, generator=g)
    out = torch.empty(DRAWS, dtype=torch.long)
    p2 = torch.stack([p, p])
    for i in range(DRAWS):
        out[i] = accept_sampled([int(drafts[i])], p2, q[None], g).tokens[0]
    return out


def assert_matches(tokens: torch.Tensor, p: torch.Tensor) -> None:
    observed = torch.bincount(tokens, minlength=p.numel()).double()
    support = p > 0
    assert observed[~support].sum() == 0, "a token the target gives zero probability came out"
    expected = p[support].double() * DRAWS
    assert chisquare(observed[support].numpy(), expected.numpy()).pvalue > 0.001


def test_sampled_acceptance_reproduces_the_target_distribution():
    p = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
    q = torch.tensor([0.10, 0.10, 0.40, 0.05, 0.30, 0.05])
    assert_matches(first_tokens(p, q, seed=1), p)


def test_drafts_the_target_rules_out_are_never_emitted():
    # The draft puts most of its mass where the target has none.
    p = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0])
    q = torch.tensor([0.05, 0.05, 0.1, 0.4, 0.4])
    assert_matches(first_tokens(p, q, seed=2), p)


def test_identical_draft_is_always_accepted():
    p = torch.tensor([0.5, 0.3, 0.2])
    g = torch.Generator().manual_seed(0)
    verdicts = [accept_sampled([t], torch.stack([p, p]), p[None], g) for t in (0, 1, 2) * 100]
    assert all(v.accepted == 1 and len(v.tokens) == 2 for v in verdicts)
