"""What a benchmark asks of a server (the Workload), and its prompts built to an exact token count.

Prompts are random pseudo-words sent to /v1/completions as token ids, so the server processes
exactly the ids we counted with its own /tokenize (a chat template would add a shared system
prefix that the cache reuses). Each starts with a random token drawn from a per-session nonce:
the seed fixes the text, the nonce keeps a second session against the same server from meeting
the first one's prompts in a slot's cache.
"""
from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Awaitable, Callable


class FixtureError(Exception):
    """The benchmark cannot be set up as asked (server unreachable, model unknown, prompt not
    buildable to the exact length); raised before any measured request is sent."""


@dataclass(frozen=True)
class Workload:
    prompt_tokens: int
    gen_tokens: int
    lanes: int  # concurrent requests per round
    runs: int  # rounds
    seed: int = 0  # the prompts' text and the sampling seed
    temperature: float = 0.0  # greedy by default: drafts' acceptance then depends on the model alone
    name: str = "custom"

    def __post_init__(self):
        for key in ("prompt_tokens", "gen_tokens", "lanes", "runs"):
            if getattr(self, key) < 1:
                raise FixtureError(f"{key}={getattr(self, key)}: must be >= 1")
        if self.temperature < 0:
            raise FixtureError(f"temperature={self.temperature}: must be >= 0")

    def describe(self) -> dict:
        return asdict(self)


# The named workloads every benchmark (this client, the side-by-side comparison) reuses.
WORKLOADS = {
    "standard": Workload(prompt_tokens=2048, gen_tokens=256, lanes=2, runs=3, name="standard"),
    "short": Workload(prompt_tokens=512, gen_tokens=64, lanes=1, runs=3, name="short"),
}

WARMUP_GEN_TOKENS = 16  # enough steps for the first-call costs; the prompt keeps its full length
_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def pseudo_words(rng: random.Random, n: int) -> list[str]:
    """Pronounceable nonsense words, some capitalised or followed by punctuation: tokenizers split
    them into ordinary word pieces, and no model has seen them together, so neither the cache nor
    an n-gram drafter gets a free ride."""
    words = []
    for _ in range(n):
        word = "".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 3)))
        word = word.capitalize() if rng.random() < 0.1 else word
        words.append(word + rng.choice(",.") if rng.random() < 0.1 else word)
    return words


@dataclass
class Prompts:
    warmup: list[int]
    rounds: list[list[list[int]]]  # [run][lane] -> token ids


Tokenize = Callable[[str], Awaitable[list[int]]]


async def build_prompts(tokenize: Tokenize, workload: Workload, nonce: str) -> Prompts:
    """Every prompt of the session, each exactly workload.prompt_tokens ids as `tokenize` counts.

    The server reuses any common prefix, even one token, so what keeps a prompt fresh is its first
    token: drawn with the nonce, distinct within the session, from every token the session's text
    produced (hundreds with a real vocabulary), which makes meeting an earlier session's prompt in
    a slot unlikely. The rest is the seed's text."""
    keys = [f"{run}:{lane}" for run in range(workload.runs) for lane in range(workload.lanes)] + ["warmup"]
    bodies = [await body_ids(tokenize, workload, key) for key in keys]
    seen = sorted({t for body in bodies for t in body})
    if len(seen) < len(keys):
        raise FixtureError(f"{len(keys)} prompts need distinct first tokens; the text gave only {len(seen)} "
                           "distinct tokens")
    firsts = random.Random(nonce).sample(seen, len(keys))
    prompts = [[first, *body] for first, body in zip(firsts, bodies)]
    rounds = [prompts[r * workload.lanes:(r + 1) * workload.lanes] for r in range(workload.runs)]
    return Prompts(prompts[-1], rounds)


async def body_ids(tokenize: Tokenize, workload: Workload, key: str) -> list[int]:
    """The first prompt_tokens - 1 token ids of the seed's text for `key`. Every pseudo-word is at
    least one token, so prompt_tokens words are enough unless the tokenizer merges words."""
    n = workload.prompt_tokens - 1
    text = " ".join(pseudo_words(random.Random(f"{workload.seed}:{key}"), workload.prompt_tokens))
    ids = await tokenize(text)
    if len(ids) < n:
        raise FixtureError(f"/tokenize gave {len(ids)} tokens for {workload.prompt_tokens} words; "
                           f"cannot build a {workload.prompt_tokens}-token prompt")
    return ids[:n]
