"""/metrics of the proxy (Prometheus text): requests, queues, per-model speed from the servers'
final `timings`, jobs by status. Counters change on the event loop only; gauges are read from the
controller when the page is rendered."""
from __future__ import annotations

from collections import defaultdict

from server.protocol import TimingTotals

PREFIX = "tandem_proxy_"


def _label(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class ProxyMetrics:
    def __init__(self):
        self.requests: dict[tuple[str, int], int] = defaultdict(int)  # (model, status) -> count
        self.totals: dict[str, TimingTotals] = defaultdict(TimingTotals)

    def on_request(self, model: str, status: int, timings: dict | None) -> None:
        self.requests[(model, status)] += 1
        if timings:
            try:
                self.totals[model].add(timings)
            except (TypeError, ValueError):
                pass  # a server that sends odd timings must not break the request

    def render(self, models: list[dict], job_counts: dict[str, int]) -> str:
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, rows: list[tuple[dict, float]]) -> None:
            lines.extend([f"# HELP {PREFIX}{name} {help_}", f"# TYPE {PREFIX}{name} {kind}"])
            for labels, value in rows:
                text = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
                lines.append(f"{PREFIX}{name}{{{text}}} {value}" if text else f"{PREFIX}{name} {value}")

        def rate(n: float, d: float) -> float:
            return n / d if d > 0 else 0.0

        metric("requests_total", "counter", "Requests relayed to a server, by model and HTTP status.",
               [({"model": m, "status": s}, n) for (m, s), n in sorted(self.requests.items())])
        metric("requests_in_flight", "gauge", "Requests holding a slot now.",
               [({"model": m["model"]}, m["in_flight"]) for m in models])
        metric("queue_depth", "gauge", "Requests waiting for a slot (or for a load).",
               [({"model": m["model"]}, m["queue_depth"]) for m in models])
        metric("replicas_ready", "gauge", "Replicas taking requests.",
               [({"model": m["model"]}, sum(r["state"] == "ready" for r in m["replicas"])) for m in models])
        t = sorted(self.totals.items())
        metric("prompt_tokens_total", "counter", "Prompt tokens processed (from timings).",
               [({"model": m}, v.prompt_tokens) for m, v in t])
        metric("predicted_tokens_total", "counter", "Tokens generated (from timings).",
               [({"model": m}, v.predicted_tokens) for m, v in t])
        metric("prompt_tokens_per_second", "gauge", "PP: prompt tokens per second of prompt time.",
               [({"model": m}, rate(v.prompt_tokens, v.prompt_seconds)) for m, v in t])
        metric("predicted_tokens_per_second", "gauge", "TG: generated tokens per second of generation time.",
               [({"model": m}, rate(v.predicted_tokens, v.predicted_seconds)) for m, v in t])
        metric("draft_tokens_total", "counter", "Tokens drafted for speculation.",
               [({"model": m}, v.draft_tokens) for m, v in t])
        metric("draft_acceptance_ratio", "gauge", "Drafted tokens accepted / drafted.",
               [({"model": m}, rate(v.draft_accepted, v.draft_tokens)) for m, v in t])
        metric("jobs", "gauge", "Job records by status.", [({"status": s}, n) for s, n in job_counts.items()])
        return "\n".join(lines) + "\n"
