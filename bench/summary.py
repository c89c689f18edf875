"""Figures from records: per lane and overall PP/TG (median, min, max), TTFT and inter-token
latency percentiles, draft acceptance and aggregate throughput per round; as a table or JSON.

Rates and latencies come from valid records only; invalid ones are counted by reason beside
them, never dropped silently. Every rendering carries the session's configuration."""
from __future__ import annotations

import dataclasses
import statistics
from collections import Counter
from dataclasses import dataclass

from rich.console import Group
from rich.table import Table
from rich.text import Text

from bench.records import Record


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default), p in [0, 100]."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100.0
    lo = int(k)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


@dataclass
class Spread:
    median: float
    min: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> "Spread | None":
        return cls(statistics.median(values), min(values), max(values)) if values else None


@dataclass
class Percentiles:
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: list[float]) -> "Percentiles | None":
        return cls(*(percentile(values, p) for p in (50, 90, 99))) if values else None


@dataclass
class Scope:
    """One lane's records, or all of them."""
    name: str
    records: int
    valid: int
    pp: Spread | None  # prompt tokens/s, as the server timed them
    tg: Spread | None  # generated tokens/s of one request
    ttft_ms: Percentiles | None
    itl_ms: Percentiles | None  # over every gap between content chunks of every request

    @classmethod
    def of(cls, name: str, records: list[Record]) -> "Scope":
        ok = [r for r in records if r.valid]
        return cls(name, len(records), len(ok),
                   Spread.of([r.prompt_per_second for r in ok if r.prompt_per_second is not None]),
                   Spread.of([r.predicted_per_second for r in ok if r.predicted_per_second is not None]),
                   Percentiles.of([r.ttft_ms for r in ok if r.ttft_ms is not None]),
                   Percentiles.of([gap for r in ok for gap in r.itl_ms]))


@dataclass
class Round:
    run: int
    requests: int
    valid: int
    clean: bool  # every lane's request came back valid
    wall_s: float  # first request sent to last stream ended
    generated: int  # tokens, over every lane
    draft_n: int
    draft_n_accepted: int

    @property
    def aggregate_tg(self) -> float | None:
        return self.generated / self.wall_s if self.wall_s > 0 else None

    @property
    def acceptance(self) -> float | None:
        return self.draft_n_accepted / self.draft_n if self.draft_n else None

    @classmethod
    def of(cls, run: int, records: list[Record], lanes: int) -> "Round":
        ends = [r.end_s for r in records if r.end_s is not None]
        wall = max(ends) - min(r.start_s for r in records) if ends else 0.0
        ok = [r for r in records if r.valid]
        return cls(run, len(records), len(ok), len(ok) == lanes == len(records), wall,
                   sum(r.predicted_n or 0 for r in records),
                   sum(r.draft_n or 0 for r in ok), sum(r.draft_n_accepted or 0 for r in ok))


@dataclass
class Summary:
    config: dict
    interrupted: bool
    records: int
    valid: int
    invalid: dict[str, int]  # reason -> records
    cache_unknown: int  # records from a server that sent no timings: reuse cannot be ruled out
    scopes: list[Scope]  # each lane, then "all"
    rounds: list[Round]
    aggregate_tg: Spread | None  # over clean rounds only: a reused prefix or a short generation skews them

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        for row, r in zip(out["rounds"], self.rounds):
            row.update(aggregate_tg=r.aggregate_tg, acceptance=r.acceptance)
        return out


def summarize(records: list[Record], config: dict, interrupted: bool = False) -> Summary:
    lanes = sorted({r.lane for r in records})
    runs = sorted({r.run for r in records})
    rounds = [Round.of(run, [r for r in records if r.run == run], config["lanes"]) for run in runs]
    clean = [r.aggregate_tg for r in rounds if r.clean and r.aggregate_tg is not None]
    return Summary(
        config=config, interrupted=interrupted, records=len(records), valid=sum(r.valid for r in records),
        invalid=dict(Counter(r.invalid_reason for r in records if not r.valid).most_common()),
        cache_unknown=sum(r.valid and not r.cache_known for r in records),
        scopes=[Scope.of(f"lane {lane}", [r for r in records if r.lane == lane]) for lane in lanes]
        + [Scope.of("all", records)],
        rounds=rounds, aggregate_tg=Spread.of(clean))


def config_line(config: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in config.items())


def _num(v: float) -> str:
    return f"{v:.1f}" if abs(v) < 1000 else f"{v:.0f}"


def _spread(s: Spread | None) -> str:
    return "-" if s is None else f"{_num(s.median)} ({_num(s.min)}-{_num(s.max)})"


def _pct(p: Percentiles | None) -> str:
    return "-" if p is None else f"{_num(p.p50)}/{_num(p.p90)}/{_num(p.p99)}"


def render(summary: Summary) -> Group:
    """Rich renderables: the configuration, the per-scope table, the per-round table, the notes."""
    scopes = Table(title="requests (valid records only)",
                   caption="tok/s: median (min-max); ms: p50/p90/p99; ITL: gaps between content chunks")
    for col in ("scope", "valid", "PP tok/s", "TG tok/s", "TTFT ms", "ITL ms"):
        scopes.add_column(col, justify="left" if col == "scope" else "right")
    for s in summary.scopes:
        scopes.add_row(s.name, f"{s.valid}/{s.records}", _spread(s.pp), _spread(s.tg), _pct(s.ttft_ms), _pct(s.itl_ms))
    rounds = Table(title="rounds")
    for col in ("run", "valid", "wall s", "aggregate TG tok/s", "draft acceptance"):
        rounds.add_column(col, justify="right")
    for r in summary.rounds:
        acceptance = "-" if r.acceptance is None else f"{r.acceptance:.3f} ({r.draft_n_accepted}/{r.draft_n})"
        aggregate = "-" if r.aggregate_tg is None else f"{r.aggregate_tg:.1f}" + ("" if r.clean else " (not clean)")
        rounds.add_row(str(r.run), f"{r.valid}/{r.requests}", f"{r.wall_s:.2f}", aggregate, acceptance)
    notes = [Text(config_line(summary.config), style="dim"), scopes, rounds,
             Text(f"aggregate TG over clean rounds: {_spread(summary.aggregate_tg)} tok/s")]
    if summary.invalid:
        notes.append(Text(f"invalid records: {summary.records - summary.valid} of {summary.records}", style="yellow"))
        notes += [Text(f"  {n} x {reason}", style="yellow") for reason, n in summary.invalid.items()]
    if summary.cache_unknown:
        notes.append(Text(f"cache reuse unknown for {summary.cache_unknown} records (the server sent no timings)",
                          style="yellow"))
    if summary.interrupted:
        notes.append(Text("interrupted: figures cover the records so far", style="bold red"))
    return Group(*notes)
