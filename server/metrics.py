"""/metrics: llama-server's metric names under a `tandem:` prefix, plus latency histograms.

Counters are updated on the event loop when a request finishes (no locks); gauges that describe
the engine's state are read from it when the page is rendered.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from server.protocol import TimingTotals

PREFIX = "tandem:"
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5)


@dataclass
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(default_factory=list)
    total: float = 0.0
    n: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * len(self.buckets)

    def observe(self, value: float) -> None:
        i = bisect.bisect_left(self.buckets, value)
        if i < len(self.counts):
            self.counts[i] += 1
        self.total += value
        self.n += 1

    def lines(self, name: str, help_: str) -> list[str]:
        out = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        running = 0
        for le, c in zip(self.buckets, self.counts):
            running += c
            out.append(f'{name}_bucket{{le="{le}"}} {running}')
        out += [f'{name}_bucket{{le="+Inf"}} {self.n}', f"{name}_sum {self.total:.6f}", f"{name}_count {self.n}"]
        return out


@dataclass
class EngineGauges:
    """What /metrics reads from the engine at render time."""
    steps: int
    busy_slots: int
    preemptions: int
    processing: int
    deferred: int
    kv_tokens: int
    kv_capacity: int
    n_tokens_max: int
    drafted_at: list[int]  # per draft position: times a draft reached it
    accepted_at: list[int]  # and times it was accepted
    siblings_kept: int = 0  # steps whose kept path ended in a sibling (--spec-draft-width)


@dataclass
class Metrics:
    totals: TimingTotals = field(default_factory=TimingTotals)
    requests_total: int = 0
    requests_cancelled: int = 0  # of requests_total, those the client left before they finished
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))

    def on_finished(self, timings: dict, cancelled: bool = False) -> None:
        """A request ended, its tokens so far counted; `cancelled`: its client left first."""
        self.requests_total += 1
        self.requests_cancelled += cancelled
        self.totals.add(timings)

    def render(self, g: EngineGauges) -> str:
        t = self.totals

        def rate(n, s):
            return n / s if s > 0 else 0.0

        counters = [
            ("prompt_tokens_total", t.prompt_tokens, "Number of prompt tokens processed."),
            ("prompt_seconds_total", t.prompt_seconds, "Prompt process time."),
            ("tokens_predicted_total", t.predicted_tokens, "Number of generation tokens processed."),
            ("tokens_predicted_seconds_total", t.predicted_seconds, "Predict process time."),
            ("prompt_tokens_cached_total", t.cached_tokens, "Number of prompt tokens reused from a slot."),
            ("n_decode_total", g.steps, "Total number of engine steps (forward passes)."),
            ("preemptions_total", g.preemptions,
             "Number of times a request was paused for want of KV room, to resume later."),
            ("requests_total", self.requests_total, "Number of requests ended, cancelled ones included."),
            ("requests_cancelled_total", self.requests_cancelled,
             "Number of requests whose client left before they finished (counted in requests_total too)."),
            ("draft_tokens_total", t.draft_tokens, "Number of tokens drafted for speculation."),
            ("draft_tokens_accepted_total", t.draft_accepted, "Number of drafted tokens accepted."),
            ("draft_siblings_kept_total", g.siblings_kept,
             "Number of steps that kept a sibling where the chain's draft was rejected."),
        ]
        gauges = [
            ("n_busy_slots_per_decode", rate(g.busy_slots, g.steps), "Average number of busy slots per step."),
            ("prompt_tokens_seconds", rate(t.prompt_tokens, t.prompt_seconds),
             "Average prompt throughput in tokens/s."),
            ("predicted_tokens_seconds", rate(t.predicted_tokens, t.predicted_seconds),
             "Average generation throughput in tokens/s."),
            ("kv_cache_usage_ratio", rate(g.kv_tokens, g.kv_capacity), "KV-cache usage. 1 means 100 percent usage."),
            ("kv_cache_tokens", g.kv_tokens, "KV-cache tokens."),
            ("requests_processing", g.processing, "Number of requests processing."),
            ("requests_deferred", g.deferred, "Number of requests deferred."),
            ("n_tokens_max", g.n_tokens_max, "Largest observed n_tokens."),
        ]
        lines = []
        for kind, rows in (("counter", counters), ("gauge", gauges)):
            for name, value, help_ in rows:
                lines += [f"# HELP {PREFIX}{name} {help_}", f"# TYPE {PREFIX}{name} {kind}", f"{PREFIX}{name} {value}"]
        name = f"{PREFIX}draft_position_acceptance_ratio"
        lines += [f"# HELP {name} Share of drafts accepted at each draft position (0 is the first).",
                  f"# TYPE {name} gauge"]
        lines += [f'{name}{{position="{i}"}} {rate(a, d)}' for i, (d, a) in enumerate(zip(g.drafted_at, g.accepted_at))]
        lines += self.ttft.lines(f"{PREFIX}time_to_first_token_seconds", "Time to first token.")
        lines += self.itl.lines(f"{PREFIX}inter_token_latency_seconds", "Time between generated tokens.")
        return "\n".join(lines) + "\n"
