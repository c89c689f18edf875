"""`python -m bench.fair_share`: many long prompts at once on the main command; every stream must
finish, and none may wait more than its fair share.

    python -m bench.fair_share [--streams 12] [--prompt-tokens 1000 3000] [--max-tokens 128]
                               [--server-args ...] [--json FILE]

Starts the main command (`python -m server -m default`, plus --server-args) on a free loopback
port and sends --streams streamed /v1/completions 50 ms apart, each a prompt of pseudo-words of a
random length in --prompt-tokens (token ids, counted by the server's /tokenize), greedy, of
--max-tokens tokens. They ask more of the shared KV pool than it holds, so the scheduler admits,
preempts and resumes them.

A stream's fair share, as a FIFO queue promises it: it waits for its turn no longer than the
streams that arrived before it take to end. Its wait is from its arrival to its admission (its
first token less its prompt time, from the final chunk's timings); its bound is the latest end
among the streams ahead of it (0 for the first), plus a slack of one step's worth, 0.25 s.
Reported per stream: prompt tokens, wait, bound, first token, end, the longest gap between two of
its chunks (a preemption shows there), how many later arrivals had their first token before it;
and whether every stream finished and every wait stayed within its bound.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from bench.client import tokenize
from bench.processes import ServerProcess
from bench.workload import pseudo_words

SLACK_S = 0.25
ARRIVAL_GAP_S = 0.05


@dataclass
class StreamRecord:
    arrival: int  # its place in the order of sending
    prompt_tokens: int
    sent: float = 0.0  # seconds from the first send
    first: float = 0.0
    end: float = 0.0
    prompt_ms: float = 0.0
    finish_reason: str | None = None
    done: bool = False
    gaps: list[float] = field(default_factory=list)

    @property
    def waited(self) -> float:
        return max(0.0, self.first - self.prompt_ms / 1000 - self.sent)


async def prompt_ids(http: httpx.AsyncClient, seed: int, n: int) -> list[int]:
    ids = await tokenize(http, " ".join(pseudo_words(random.Random(seed), n)), "default")
    assert len(ids) >= n, f"{n} words gave only {len(ids)} tokens"
    return ids[:n]


async def one_stream(http: httpx.AsyncClient, record: StreamRecord, ids: list[int], max_tokens: int,
                     start: float) -> None:
    await asyncio.sleep(record.arrival * ARRIVAL_GAP_S)
    record.sent = time.monotonic() - start
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    last = None
    async with http.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            now = time.monotonic() - start
            if line == "data: [DONE]":
                record.done = True
                break
            chunk = json.loads(line[len("data: "):])
            if last is None:
                record.first = now
            else:
                record.gaps.append(now - last)
            last = now
            for choice in chunk.get("choices", []):
                record.finish_reason = choice.get("finish_reason") or record.finish_reason
            if "timings" in chunk:
                record.prompt_ms = chunk["timings"]["prompt_ms"]
    record.end = time.monotonic() - start


async def run(url: str, streams: int, lengths: tuple[int, int], max_tokens: int, seed: int) -> list[StreamRecord]:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=url, timeout=1800) as http:
        records = [StreamRecord(k, rng.randint(*lengths)) for k in range(streams)]
        prompts = [await prompt_ids(http, seed * 1000 + r.arrival, r.prompt_tokens) for r in records]
        start = time.monotonic()
        await asyncio.gather(*(one_stream(http, r, ids, max_tokens, start) for r, ids in zip(records, prompts)))
    return records


def judge(records: list[StreamRecord]) -> dict:
    rows, fair = [], True
    for r in records:
        ahead = [o.end for o in records if o.arrival < r.arrival]
        bound = max(0.0, max(ahead, default=0.0) - r.sent) + SLACK_S
        overtaken = sum(o.arrival > r.arrival and o.first < r.first for o in records)
        within = r.waited <= bound
        fair = fair and within
        rows.append({"arrival": r.arrival, "prompt_tokens": r.prompt_tokens, "waited_s": round(r.waited, 2),
                     "bound_s": round(bound, 2), "within": within, "first_token_s": round(r.first - r.sent, 2),
                     "end_s": round(r.end - r.sent, 2), "longest_gap_s": round(max(r.gaps, default=0.0), 2),
                     "overtaken_by": overtaken, "finish_reason": r.finish_reason})
    finished = all(r.done and r.finish_reason in ("length", "stop") for r in records)
    return {"all_finished": finished, "all_within_fair_share": fair,
            "makespan_s": round(max(r.end for r in records), 1), "streams": rows}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.fair_share", description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=12)
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=(1000, 3000), metavar=("MIN", "MAX"))
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-m", "--model", default="default")
    ap.add_argument("--server-args", nargs=argparse.REMAINDER, default=[], help="added to the main command")
    ap.add_argument("--json", type=Path, help="write the report here")
    a = ap.parse_args()
    log = Path(tempfile.mkdtemp(prefix="fair-share-")) / "server.log"
    server = ServerProcess(["-m", a.model, *a.server_args], log, threads=None)
    try:
        server.wait_ready()
        records = asyncio.run(run(server.url, a.streams, tuple(a.prompt_tokens), a.max_tokens, a.seed))
    finally:
        server.kill()
    report = {"server_args": ["-m", a.model, *a.server_args], **judge(records), "log": str(log),
              "raw": [asdict(r) for r in records]}
    print(json.dumps({k: v for k, v in report.items() if k != "raw"}, indent=1), flush=True)
    if a.json:
        a.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
