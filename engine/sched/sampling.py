"""Sampling parameters and the sampler: logits -> (penalties, bias, filters) -> a token.

The sampler exposes the final distribution as well as a draw from it, because speculative
verification needs the target's distribution p for its acceptance rule.

Sampling is total over every value validation admits (finite numbers in each field's range), so
no request's parameters can make it raise. The extreme values mean:
- a temperature below MIN_TEMPERATURE is greedy, as 0 is;
- penalties and biases act in float64, and each adjusted logit is clamped to +-LOGIT_LIMIT: a bias
  of 1e39 makes a token certain, one of -1e39 bans it; a repetition penalty of 1e308 takes a
  recent token's positive logit to 0, one of 1e-300 makes the likeliest recent token certain;
- top_p and min_p always keep the most likely token, however small they are.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from engine.errors import check_rules

PENALTY_LAST_N = 64  # as llama.cpp: penalties look at the last 64 tokens of the sequence
MIN_TEMPERATURE = 1e-6
# Far beyond any model's logits, and small enough that LOGIT_LIMIT / MIN_TEMPERATURE is finite in f32.
LOGIT_LIMIT = 1e6


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 (or below MIN_TEMPERATURE) is greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logit_bias: dict[int, float] = field(default_factory=dict)
    logprobs: int | None = None  # None: no logprobs; n: the chosen token's plus the top n

    def __post_init__(self) -> None:
        check_rules([
            (math.isfinite(self.temperature) and self.temperature >= 0, "temperature", self.temperature,
             "must be a finite number >= 0"),
            (self.top_k >= 0, "top_k", self.top_k, "must be >= 0"),
            (0 < self.top_p <= 1, "top_p", self.top_p, "must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p", self.min_p, "must be in [0, 1]"),
            (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0, "repetition_penalty",
             self.repetition_penalty, "must be > 0"),
            (math.isfinite(self.presence_penalty), "presence_penalty", self.presence_penalty, "must be finite"),
            (math.isfinite(self.frequency_penalty), "frequency_penalty", self.frequency_penalty, "must be finite"),
            (self.max_tokens >= 1, "max_tokens", self.max_tokens, "must be >= 1"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "top_logprobs", self.logprobs, "must be in [0, 20]"),
        ])

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


def make_generator(seed: int | None) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed if seed is not None else torch.seed())
    return g


def adjust_logits(logits: torch.Tensor, params: SamplingParams, history: list[int]) -> torch.Tensor:
    """Penalties and logit bias applied to one row of logits [vocab]: a new f32 tensor, each value
    within +-LOGIT_LIMIT."""
    logits = logits.double()
    if params.has_penalties and history:
        recent = torch.tensor(history[-PENALTY_LAST_N:], dtype=torch.long)
        ids, counts = recent.unique(return_counts=True)
        selected = logits[ids]
        if params.repetition_penalty != 1:
            selected = torch.where(selected > 0, selected / params.repetition_penalty,
                                   selected * params.repetition_penalty).clamp(-LOGIT_LIMIT, LOGIT_LIMIT)
        # Each term is finite or infinite, never NaN: selected is clamped, the penalties are finite.
        selected = selected - params.frequency_penalty * counts.double() - params.presence_penalty
        logits[ids] = selected.clamp(-LOGIT_LIMIT, LOGIT_LIMIT)
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype)
    return logits.clamp(-LOGIT_LIMIT, LOGIT_LIMIT).float()


def distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a token is drawn from, [vocab] f32, after temperature, top-k, top-p and
    min-p. Greedy gives a one-hot at the argmax."""
    if params.greedy:
        probs = torch.zeros_like(logits)
        probs[logits.argmax()] = 1.0
        return probs
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, -math.inf)
    probs = torch.softmax(logits, dim=-1)
    if params.min_p > 0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        drop = sorted_probs.cumsum(0) - sorted_probs >= params.top_p * sorted_probs.sum()
        drop[0] = False  # a top_p too small to hold any token still holds the likeliest
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs.masked_fill(drop, 0.0))
    return probs / probs.sum()


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from probs [vocab] (non-negative, summing to about 1) by inverting its cumulative
    sum: the first token whose cumulative mass exceeds u * total, so a token without mass is never
    drawn. torch.multinomial takes ~1.4 ms over a 49k vocabulary on this CPU, this ~0.05 ms, and a
    sampled speculative step draws up to five times."""
    cdf = probs.double().cumsum(0)
    u = torch.rand(1, generator=generator, dtype=torch.float64) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))
    # u * total can round up to the total itself; the draw then belongs to the last token with mass.
    return i if i < len(probs) else int(torch.nonzero(probs).max())


def constrained(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """One row of logits [vocab] with the tokens a grammar's mask [vocab] bool refuses at -inf,
    after any adjustment: no bias can lift a refused token over an allowed one."""
    return logits if mask is None else logits.masked_fill(~mask, -math.inf)


def choose(logits: torch.Tensor, params: SamplingParams, history: list[int], generator: torch.Generator,
           constraint=None) -> int:
    """One token from one row of logits, among those a grammar's constraint allows (engine.sched.grammar)."""
    if not (params.greedy and not params.has_penalties and not params.logit_bias):
        logits = adjust_logits(logits, params, history)
    if params.greedy:
        return int(logits.argmax()) if constraint is None else constraint.best(logits, [])
    return sample(distribution(constrained(logits, None if constraint is None else constraint.masks([[]])[0]),
                               params), generator)


def logprob_entry(logits: torch.Tensor, token: int, top: int) -> dict:
    """The chosen token's log-probability under raw logits [vocab], and the `top` most likely."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    entry = {"token": token, "logprob": float(lp[token]), "top": []}
    if top:
        values, ids = lp.topk(top)
        entry["top"] = [(int(i), float(v)) for i, v in zip(ids, values)]
    return entry
