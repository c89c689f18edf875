"""What a benchmark asks of a server (the Workload), and its prompts built to an exact token count.

Prompts are random pseudo-words sent to /v1/completions as token ids, so the server processes
exactly the ids we counted with its own /tokenize (a chat template would add a shared system
prefix that the cache reuses). Each starts with a random prefix drawn from a per-session nonce:
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
PREFIX_WORDS = 4
FIRST_TOKEN_ATTEMPTS = 64
_CONSONANTS = "bcdfghjklmnprstvwz"
_VOWELS = "aeiou"


def pseudo_words(rng: random.Random, n: int) -> list[str]:
    """Pronounceable nonsense words: tokenizers split them into ordinary word pieces, and no
    model has seen them together, so neither the cache nor an n-gram drafter gets a free ride."""
    return ["".join(rng.choice(_CONSONANTS) + rng.choice(_VOWELS) for _ in range(rng.randint(1, 3)))
            for _ in range(n)]


@dataclass
class Prompts:
    warmup: list[int]
    rounds: list[list[list[int]]]  # [run][lane] -> token ids


Tokenize = Callable[[str], Awaitable[list[int]]]


async def build_prompts(tokenize: Tokenize, workload: Workload, nonce: str) -> Prompts:
    """Every prompt of the session, each exactly workload.prompt_tokens ids as `tokenize` counts.

    No two prompts of a session share their first token: the server reuses any common prefix,
    even one token, so a shared first token would make a request less than fresh."""
    used: set[int] = set()
    indices = [(run, lane) for run in range(workload.runs) for lane in range(workload.lanes)]
    built = [await _fresh_prompt(tokenize, workload, nonce, f"{run}:{lane}", used) for run, lane in indices]
    warmup = await _fresh_prompt(tokenize, workload, nonce, "warmup", used)
    rounds = [built[r * workload.lanes:(r + 1) * workload.lanes] for r in range(workload.runs)]
    return Prompts(warmup, rounds)


async def _fresh_prompt(tokenize: Tokenize, workload: Workload, nonce: str, key: str, used: set[int]) -> list[int]:
    body = " ".join(pseudo_words(random.Random(f"{workload.seed}:{key}"), workload.prompt_tokens))
    for attempt in range(FIRST_TOKEN_ATTEMPTS):
        prefix = " ".join(pseudo_words(random.Random(f"{nonce}:{key}:{attempt}"), PREFIX_WORDS)).capitalize()
        ids = await exact_ids(tokenize, f"{prefix} {body}", workload.prompt_tokens)
        if ids[0] not in used:
            used.add(ids[0])
            return ids
    raise FixtureError(f"cannot give {len(used) + 1} prompts distinct first tokens in {FIRST_TOKEN_ATTEMPTS} "
                       "attempts: the tokenizer has too few word-start tokens for this many requests")


async def exact_ids(tokenize: Tokenize, text: str, n: int) -> list[int]:
    """The first n token ids of `text`; every pseudo-word is at least one token, so a text of n
    words is long enough unless the tokenizer merges words."""
    ids = await tokenize(text)
    if len(ids) < n:
        raise FixtureError(f"/tokenize gave {len(ids)} tokens for {len(text.split())} words; "
                           f"cannot build a {n}-token prompt")
    return ids[:n]
