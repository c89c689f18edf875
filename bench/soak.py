"""`python -m bench.soak`: many clients for minutes against real servers, counting what was lost.

    python -m bench.soak [--minutes 10] [--clients 16] [--model default] [--json FILE]

For each server configuration (default: `-np 2`, then `-np 4 --kv-unified`, both `-c 4096`), starts
`python -m server` on a free loopback port and runs `--clients` concurrent clients until the time is
up. Each client loops: a streamed /v1/completions of a random prompt length (8-400 words) and
length (8-128 tokens); 10% of them leave after a few chunks; 5% send an invalid body instead and
must get a 400. Reported per configuration: requests completed, left on purpose, refused as
invalid, valid ones refused (4xx, each named), cut (a stream the server ended early with an error
event and [DONE]), unavailable (a 503, or no answer at all while a proxy restarts: the client waits
and tries again), lost (a stream that ended without its finish_reason and [DONE] and without an
error event, or a request that failed mid-way or timed out: none allowed), other 5xx (none
allowed), p50/p99 time to first token, and the server's resident memory at start and end.
bench.proxy_soak runs the same clients through a proxy.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.client import error_message
from bench.processes import ServerProcess

CONFIGS = {"np2": ["-np", "2", "-c", "4096"], "np4-unified": ["-np", "4", "-c", "4096", "--kv-unified"]}
WORDS = ("tide shore shell river stone lantern harbour window garden letter winter market bridge "
         "mountain violin orchard candle compass meadow ferry").split()
INVALID_BODIES = [
    {"prompt": "hi", "temperature": -1},
    {"prompt": "hi", "max_tokens": 0},
    {"prompt": "hi", "top_p": 2},
    {"prompt": 5},
    {"messages": "not a list"},
]


@dataclass
class Tally:
    config: str
    completed: int = 0
    left: int = 0  # streams the client closed on purpose
    invalid: int = 0  # invalid bodies answered 400, as they must be
    refused: int = 0  # valid bodies answered 4xx (e.g. a prompt too long for a slot), each named in problems
    cut: int = 0  # streams ended early with an error event and [DONE]
    unavailable: int = 0  # 503s and refused connections (a proxy restarting), tried again after a wait
    lost: int = 0
    server_errors: int = 0
    problems: list[str] = field(default_factory=list)  # the first few lost or 5xx, for the report
    reasons: Counter = field(default_factory=Counter)  # why streams were cut and requests unavailable
    ttft_ms: list[float] = field(default_factory=list)
    rss_start_mb: float = 0.0
    rss_end_mb: float = 0.0

    def note(self, problem: str) -> None:
        if len(self.problems) < 10:
            self.problems.append(problem)

    def summary(self) -> dict:
        ttft = sorted(self.ttft_ms)
        pct = (lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))]) if ttft else (lambda q: 0.0)
        # asdict rebuilds a Counter from (key, value) pairs, which counts the pairs: reasons go as they are
        out = {k: v for k, v in asdict(self).items() if k not in ("ttft_ms", "reasons")}
        out["reasons"] = dict(self.reasons.most_common())
        out.update(ttft_p50_ms=round(statistics.median(ttft), 1) if ttft else 0.0, ttft_p99_ms=round(pct(0.99), 1))
        return out


def unavailable(tally: Tally, headers: httpx.Headers, body: bytes) -> float:
    """Tallies a 503; how long to wait before trying again (its Retry-After, at most 5 s)."""
    tally.unavailable += 1
    tally.reasons[f"503: {error_message(body.decode(errors='replace'))}"] += 1
    return min(float(headers.get("retry-after", 1)), 5.0)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def one_request(http: httpx.AsyncClient, tally: Tally, rng: random.Random, i: int, max_words: int,
                      model: str | None) -> float:
    """One request and its tally; how long to wait before the next (a 503's Retry-After)."""
    named = {"model": model} if model else {}
    roll = rng.random()
    if roll < 0.05:
        r = await http.post("/v1/completions", json={**rng.choice(INVALID_BODIES), **named})
        if r.status_code == 503:
            return unavailable(tally, r.headers, r.content)
        if r.status_code == 400:
            tally.invalid += 1
        elif r.status_code >= 500:
            tally.server_errors += 1
            tally.note(f"invalid body -> {r.status_code}: {r.text[:200]}")
        else:
            tally.lost += 1
            tally.note(f"invalid body -> {r.status_code}, not 400")
        return 0.0
    leave_after = rng.randint(1, 4) if roll < 0.15 else None
    words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, max_words)))
    body = {"prompt": f"{i}: {words}", "max_tokens": rng.randint(8, 128), "stream": True, "temperature": 0.7,
            "seed": i, **named}
    t0, chunks, finished, done, error = time.perf_counter(), 0, False, False, None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code == 503:
            return unavailable(tally, r.headers, await r.aread())
        if r.status_code != 200:
            tally.server_errors += r.status_code >= 500
            tally.refused += r.status_code < 500
            tally.note(f"stream -> {r.status_code}: {(await r.aread())[:200]!r}")
            return 0.0
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                error = chunk["error"]["message"]
                continue
            if chunks == 0:
                tally.ttft_ms.append(1000 * (time.perf_counter() - t0))
            chunks += 1
            finished = finished or any(c.get("finish_reason") for c in chunk.get("choices", []))
            if leave_after is not None and chunks >= leave_after:
                tally.left += 1
                return 0.0
    if finished and done:
        tally.completed += 1
    elif error and done:
        tally.cut += 1
        tally.reasons[f"cut: {error}"] += 1
    else:
        tally.lost += 1
        tally.note(f"stream ended after {chunks} chunks without finish_reason and [DONE]"
                   + (f" (error event: {error})" if error else ""))
    return 0.0


async def client(url: str, tally: Tally, seed: int, deadline: float, max_words: int, model: str | None) -> None:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=300) as http:
        i = 0
        while time.monotonic() < deadline:
            i += 1
            try:
                wait = await one_request(http, tally, rng, seed * 1_000_000 + i, max_words, model)
            except httpx.ConnectError:
                tally.unavailable += 1
                tally.reasons["connection refused"] += 1
                wait = 0.5
            except httpx.HTTPError as e:
                tally.lost += 1
                tally.note(f"{type(e).__name__}: {e}")
                wait = 0.0
            await asyncio.sleep(wait)


async def soak(url: str, tally: Tally, clients: int, seconds: float, max_words: int, model: str | None = None) -> None:
    deadline = time.monotonic() + seconds
    await asyncio.gather(*(client(url, tally, seed, deadline, max_words, model) for seed in range(clients)))


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0, help="per configuration")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("-m", "--model", default="default")
    ap.add_argument("--max-words", type=int, default=400, help="longest prompt, in words (fewer for a tiny model)")
    ap.add_argument("--configs", nargs="+", choices=sorted(CONFIGS), default=list(CONFIGS))
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="added to every server's flags")
    ap.add_argument("--json", type=Path, help="write the summaries here")
    a = ap.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="soak-"))
    summaries = []
    for name in a.configs:
        server = ServerProcess(["-m", a.model, *CONFIGS[name], *a.server_args], logs / f"{name}.log")
        try:
            server.wait_ready()
            tally = Tally(name, rss_start_mb=rss_mb(server.proc.pid))
            print(f"{name}: {a.clients} clients for {a.minutes} min, server flags {CONFIGS[name] + a.server_args}",
                  flush=True)
            asyncio.run(soak(server.url, tally, a.clients, 60 * a.minutes, a.max_words))
            tally.rss_end_mb = rss_mb(server.proc.pid)
            alive = httpx.get(f"{server.url}/health", timeout=5).status_code == 200
        finally:
            server.kill()
        summary = {**tally.summary(), "healthy_after": alive, "log": str(logs / f"{name}.log")}
        summaries.append(summary)
        print(json.dumps(summary, indent=1), flush=True)
    if a.json:
        a.json.write_text(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
