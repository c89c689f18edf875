"""The acceptance rule keeps the target's distribution exactly, and greedy acceptance stops at the
first mismatch."""
from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from engine.sched.request import Draft
from engine.spec.acceptance import accept_greedy, accept_sampled

DRAWS = 50_000


def test_greedy_keeps_drafts_up_to_the_first_mismatch_then_adds_the_target_token():
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]).tokens == [5, 6, 9]
    assert accept_greedy([5, 6, 7], [5, 6, 9, 1]).accepted == 2
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1]).tokens == [5, 6, 7, 1]
    assert accept_greedy([5, 6, 7], [4, 6, 7, 1]).tokens == [4]
    assert accept_greedy([], [3]).tokens == [3]


def test_greedy_keeps_the_sibling_the_target_chose_then_the_targets_token_at_its_row():
    draft = Draft([5, 6, 7], siblings=[(0, 8), (1, 4), (1, 9)])  # rows: 0 last, 1-3 chain, 4-6 siblings
    # The target rejects 6 at depth 1 for 9, the second sibling there (row 6), and follows 9 with 2.
    verdict = accept_greedy([5, 6, 7], [5, 9, 0, 0, 0, 0, 2], draft)
    assert (verdict.accepted, verdict.tokens, verdict.rows) == (2, [5, 9, 2], [0, 1, 6])
    # No sibling matches: the target's own token, as for a chain.
    assert accept_greedy([5, 6, 7], [3, 0, 0, 0, 0, 0, 0], draft).tokens == [3]
    # The chain is kept whole: siblings play no part.
    assert accept_greedy([5, 6, 7], [5, 6, 7, 1, 0, 0, 0], draft).rows == [0, 1, 2, 3]


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


@pytest.mark.parametrize("siblings", [[1], [4, 1]])
def test_siblings_tried_after_a_rejected_draft_keep_the_target_distribution(siblings):
    # The draft is drawn from q, its siblings fixed tokens (whatever the draft was: a sibling equal
    # to it is skipped, as the drafter never proposes one); each sibling's row has its own p.
    p = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.04])
    q = torch.tensor([0.10, 0.10, 0.40, 0.05, 0.30, 0.05])
    after = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1.0])  # the target's next token after any sibling: 5
    g = torch.Generator().manual_seed(5)
    drafts = torch.multinomial(q, DRAWS, replacement=True, generator=g)
    out, kept = torch.empty(DRAWS, dtype=torch.long), 0
    for i in range(DRAWS):
        d = int(drafts[i])
        draft = Draft([d], q[None], [(0, s) for s in siblings if s != d])
        rows = torch.stack([p, p] + [after] * len(draft.siblings))
        verdict = accept_sampled([d], rows, q[None], g, draft)
        out[i] = verdict.tokens[0]
        if verdict.rows[-1] > 1:
            kept += 1
            assert verdict.tokens[1] == 5, "a kept sibling is followed by the target's token at its own row"
    assert kept > 0, "no sibling was ever kept: the rule was not exercised"
    assert_matches(out, p)


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


@pytest.mark.parametrize("siblings", [[], [1]])
def test_a_draft_cut_at_the_token_a_grammar_refuses_keeps_the_masked_distribution(siblings):
    # A grammar refuses tokens 3 and 4: p is the target's masked distribution, q the draft's
    # unmasked one, which puts most of its mass there. A refused draft is cut off before it is
    # verified (engine.sched.grammar.Constraint.cut), keeping its q as refused_q, with any sibling
    # the grammar allows; the token that follows must still be drawn from p.
    p = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0])
    q = torch.tensor([0.05, 0.05, 0.1, 0.4, 0.4])
    g = torch.Generator().manual_seed(7)
    drafts = torch.multinomial(q, DRAWS, replacement=True, generator=g)
    out, cut = torch.empty(DRAWS, dtype=torch.long), 0
    for i in range(DRAWS):
        d = int(drafts[i])
        sibs = [(0, s) for s in siblings if s != d]
        if d in (3, 4):
            cut += 1
            draft = Draft([], None, sibs, cut=True, refused_q=q)
        else:
            draft = Draft([d], q[None], sibs)
        rows = torch.stack([p] * (1 + len(draft.row)))
        out[i] = accept_sampled(draft.tokens, rows, draft.q, g, draft).tokens[0]
    assert cut > DRAWS // 2, "the refused tokens were not drafted: the cut was not exercised"
    assert_matches(out, p)


def test_greedy_tries_a_cut_drafts_siblings_at_the_depth_it_was_cut():
    # Drafted [5, 6, 7]; a grammar refused 6, so the chain is [5] with 6's sibling 9 at depth 1.
    draft = Draft([5], siblings=[(1, 9)], cut=True)  # rows: 0 last, 1 chain, 2 the sibling
    verdict = accept_greedy([5], [5, 9, 4], draft)
    assert (verdict.accepted, verdict.tokens, verdict.rows) == (2, [5, 9, 4], [0, 1, 2])
    assert accept_greedy([5], [5, 8, 4], draft).tokens == [5, 8]
