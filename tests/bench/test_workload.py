"""Prompts of an exact token count, fresh and reproducible, built with the server's tokenizer."""
from __future__ import annotations

import asyncio

import pytest

from bench.workload import FixtureError, Workload, build_prompts


async def byte_tokens(text: str) -> list[int]:
    return list(text.encode())


def build(workload: Workload, nonce: str = "n1", tokenize=byte_tokens):
    return asyncio.run(build_prompts(tokenize, workload, nonce))


def every(prompts) -> list[list[int]]:
    return [ids for run in prompts.rounds for ids in run] + [prompts.warmup]


def test_every_prompt_has_the_exact_length_and_its_own_first_token():
    prompts = build(Workload(prompt_tokens=100, gen_tokens=4, lanes=3, runs=4))
    assert len(prompts.rounds) == 4 and all(len(run) == 3 for run in prompts.rounds)
    assert all(len(ids) == 100 for ids in every(prompts))
    assert len({ids[0] for ids in every(prompts)}) == 13


def test_seed_fixes_the_text_and_the_nonce_only_the_first_token():
    w = Workload(prompt_tokens=200, gen_tokens=4, lanes=2, runs=2)
    a, b = build(w, "n1"), build(w, "n2")
    assert build(w, "n1") == a
    assert [ids[1:] for ids in every(a)] == [ids[1:] for ids in every(b)]
    assert [ids[0] for ids in every(a)] != [ids[0] for ids in every(b)]
    assert every(build(Workload(200, 4, 2, 2, seed=1), "n1"))[0][1:] != every(a)[0][1:]


def test_a_tokenizer_that_cannot_reach_the_length_is_a_fixture_error():
    async def merging(text: str) -> list[int]:
        return list(text.encode())[:len(text.split()) // 2]

    with pytest.raises(FixtureError, match="cannot build a 100-token prompt"):
        build(Workload(prompt_tokens=100, gen_tokens=4, lanes=1, runs=1), tokenize=merging)


def test_too_few_distinct_tokens_for_fresh_prompts_is_a_fixture_error():
    async def two_tokens(text: str) -> list[int]:
        return [1, 2] * len(text)

    with pytest.raises(FixtureError, match="3 prompts need distinct first tokens; the text gave only 2"):
        build(Workload(prompt_tokens=10, gen_tokens=4, lanes=1, runs=2), tokenize=two_tokens)


def test_workload_shape_is_checked_when_built():
    with pytest.raises(FixtureError, match="lanes=0"):
        Workload(prompt_tokens=10, gen_tokens=1, lanes=0, runs=1)
