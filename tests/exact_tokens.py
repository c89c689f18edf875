"""The exact-token rule (docs/architecture.md, "The exact-token rule"): two greedy token lists agree
when they are identical, or when their first difference sits where the reference's top-2 logits
differ by less than 1e-3."""
from __future__ import annotations

from typing import Callable

import torch

NEAR_TIE = 1e-3


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same_greedy(got: list[int], expected: list[int], prompt_ids: list[int],
                       reference_logits: Callable[[list[int]], torch.Tensor]) -> None:
    """reference_logits(ids) gives the reference's next-token logits [vocab] after `ids`."""
    i = first_difference(got, expected)
    if i is None:
        return
    assert i < min(len(got), len(expected)), \
        f"one output is a strict prefix of the other at {i}: got {got}, expected {expected}"
    logits = reference_logits(prompt_ids + expected[:i])
    top2 = logits.topk(2).values
    gap = float(top2[0] - top2[1])
    assert gap < NEAR_TIE, (f"first difference at generated token {i} (got {got[i]}, expected {expected[i]}) "
                            f"is not a near-tie: reference top-2 logit gap {gap:.4g} >= {NEAR_TIE}")


def next_token_logits(model) -> Callable[[list[int]], torch.Tensor]:
    """reference_logits for assert_same_greedy from one of tandem's Transformers: a fresh prefill
    of the ids, in one row, on its own cache."""
    from engine.model.batch import ForwardBatch, Row
    from engine.model.kv_cache import model_cache

    def logits(ids: list[int]) -> torch.Tensor:
        cache = model_cache(model.config, model.specs, 1, len(ids))
        return model.logits(model(ForwardBatch.build([Row(0, 0, ids)]), cache)[-1:])[0]
    return logits


def under_grammar(reference_logits: Callable[[list[int]], torch.Tensor], constraint_of,
                  prompt_length: int) -> Callable[[list[int]], torch.Tensor]:
    """reference_logits for a greedy answer held to a grammar: the reference's logits with what the
    grammar refuses after the answer so far at -inf, so that a near-tie is one between tokens it
    allows. constraint_of(): a fresh matcher of that grammar (Grammars.constraint)."""
    def logits(ids: list[int]) -> torch.Tensor:
        constraint = constraint_of()
        constraint.advance(ids[prompt_length:])
        return reference_logits(ids).masked_fill(~constraint.masks([[]])[0], float("-inf"))
    return logits
