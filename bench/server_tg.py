"""`python -m bench.server_tg`: TG of the engine alone vs through the HTTP server at batch 1, and the
aggregate TG of 4 parallel streams vs 1, in alternating runs; prints medians.

    python -m bench.server_tg [-m default] [--runs 5] [--tokens 64] [--threads 2] [--dtype f32]

Workload: prompt "Once upon a time" (as /v1/completions text), greedy, ignore_eos, fixed length.
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.processes import ServerProcess, sse_events

PROMPT = "Once upon a time"


def engine_tg(engine, tokens: int) -> float:
    from engine import SamplingParams
    ids = engine.tokenizer.encode(PROMPT)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    outs = list(engine.generate(ids, params, cache_prompt=False))
    t = outs[-1].request.timings()
    return 1000.0 * t.predicted_n / t.predicted_ms


def stream_one(url: str, tokens: int, i: int) -> tuple[float, float, int, dict]:
    """(client time of first token, of last token, tokens, server timings) of one streamed completion."""
    body = {"prompt": f"{PROMPT} ({i})", "max_tokens": tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "cache_prompt": False}
    first = last = 0.0
    with httpx.Client(timeout=600) as c, c.stream("POST", f"{url}/v1/completions", json=body) as r:
        for chunk in sse_events(r):
            now = time.perf_counter()
            if chunk["choices"][0]["text"] and not first:
                first = now
            last = now
            final = chunk
    return first, last, final["timings"]["predicted_n"], final["timings"]


def http_tg(url: str, tokens: int, streams: int) -> tuple[float, float]:
    """(aggregate TG measured by the client, mean of the server-reported per-stream TG)."""
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda i: stream_one(url, tokens, i), range(streams)))
    start, end = min(r[0] for r in results), max(r[1] for r in results)
    n = sum(r[2] - 1 for r in results)  # tokens after each stream's first
    return n / (end - start), statistics.mean(r[3]["predicted_per_second"] for r in results)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.server_tg", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="default", help="as the server's -m")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="f32")
    a = ap.parse_args()
    import torch

    from engine import Engine, EngineConfig
    torch.set_num_threads(a.threads)
    print(f"model {a.model} {a.dtype}, prompt {PROMPT!r}, {a.tokens} tokens, greedy, threads={a.threads}, runs={a.runs}")
    engine = Engine.load(EngineConfig(model=a.model, ctx_size=2048, parallel=1, threads=a.threads, dtype=a.dtype))
    logs = Path(tempfile.mkdtemp())
    flags = ["-m", a.model, "-t", str(a.threads), "--dtype", a.dtype, "--spec-type", "none"]  # as the engine
    one = ServerProcess([*flags, "-np", "1", "-c", "2048"], logs / "np1.log")
    four = ServerProcess([*flags, "-np", "4", "-c", "8192"], logs / "np4.log")
    try:
        one.wait_ready(), four.wait_ready()
        for url in (one.url, four.url):  # warm-up
            http_tg(url, 8, 1)
        engine_tg(engine, 8)
        rows = {"engine b1": [], "http b1 (client)": [], "http b1 (server timings)": [],
                "http np4 x1 (client)": [], "http np4 x4 aggregate (client)": []}
        for run in range(a.runs):
            rows["engine b1"].append(engine_tg(engine, a.tokens))
            client, server = http_tg(one.url, a.tokens, 1)
            rows["http b1 (client)"].append(client)
            rows["http b1 (server timings)"].append(server)
            rows["http np4 x1 (client)"].append(http_tg(four.url, a.tokens, 1)[0])
            rows["http np4 x4 aggregate (client)"].append(http_tg(four.url, a.tokens, 4)[0])
            print(f"run {run}: " + json.dumps({k: round(v[-1], 2) for k, v in rows.items()}), flush=True)
        med = {k: statistics.median(v) for k, v in rows.items()}
        for k, v in med.items():
            print(f"median {k}: {v:.2f} tok/s")
        print(f"http b1 / engine b1: {med['http b1 (client)'] / med['engine b1']:.3f}")
        print(f"np4 x4 / x1: {med['http np4 x4 aggregate (client)'] / med['http np4 x1 (client)']:.2f}")
    finally:
        one.kill(), four.kill()


if __name__ == "__main__":
    main()
