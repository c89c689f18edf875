"""`python -m bench.proxy_overhead`: what the proxy costs in TG and time to first token, through the
proxy vs the server directly.

    python -m bench.proxy_overhead [--model default|PATH|tiny] [--dtype bf16] [--runs 12] [--tokens 64]

Starts a proxy (with a throwaway state directory) that loads one server, then alternates the two
lanes request by request (ABBA order, so drift hits both alike). Each request is a fresh prompt of
fixed length (a unique random head, so no slot reuses a cached prefix), streamed from /v1/completions
with greedy decoding and ignore_eos. Per request, measured at the client:
  ttft_ms       send -> first content chunk
  overhead_ms   ttft_ms minus the server's own prompt_ms: HTTP and relay time without the compute,
                whose run-to-run noise would otherwise swamp a millisecond difference
  tg            (tokens - 1) / (last chunk - first chunk), tokens per second as the client sees them
Prints the configuration and the medians; the proxy's added TTFT is the difference of the two
lanes' median overhead_ms.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from bench.processes import ProxyProcess
from engine.threads import cpu_ticks

SEED = 1234


def one(url: str, prompt: str, tokens: int) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "cache_prompt": False}
    stamps, timings = [], None
    t0 = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event["choices"] and event["choices"][0].get("finish_reason") is None:
                stamps.append(time.perf_counter())  # one event per token (text may be held back: partial UTF-8)
            timings = event.get("timings") or timings
    n = len(stamps)
    ttft_ms = (stamps[0] - t0) * 1000
    return {"ttft_ms": ttft_ms, "overhead_ms": ttft_ms - timings["prompt_ms"],
            "tg": (n - 1) / (stamps[-1] - stamps[0]), "chunks": n, "server_tg": timings["predicted_per_second"]}


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.proxy_overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--runs", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-chars", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1, help="server torch threads (-t); 1 leaves a core to the rest")
    a = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # so that `finally` stops the proxy and server
    rng = random.Random(SEED)
    root = Path(tempfile.mkdtemp(prefix="tandem-bench-"))
    if a.model == "tiny":
        from engine.cli.tiny import tiny_config, write_tiny_model
        a.model = str(write_tiny_model(tiny_config(), root / "tiny"))
    proxy = ProxyProcess(root, {"bench": {"args": ["-m", a.model, "-c", "4096", "-np", "1", "--dtype", a.dtype,
                                                   "-t", str(a.threads), "--spec-type", "none"],
                                          "health_timeout": 300}})
    try:
        proxy.start()
        job = proxy.job("load", "bench", timeout=300)
        assert job["status"] == "succeeded", job
        lanes = {"direct": f"http://127.0.0.1:{proxy.replicas('bench')[0]['port']}", "proxy": proxy.url}

        def prompt() -> str:
            head = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz ") for _ in range(a.prompt_chars))
            return head + "\nContinue the story:"
        for lane in lanes.values():  # warm-up: connections, caches, first-call compilation
            one(lane, prompt(), 8)
        rows = {name: [] for name in lanes}
        proxy_ticks = 0
        for run in range(a.runs):
            order = ["direct", "proxy"] if run % 2 == 0 else ["proxy", "direct"]
            for name in order:
                before = cpu_ticks(proxy.proc.pid)
                rows[name].append(one(lanes[name], prompt(), a.tokens))
                if name == "proxy":
                    proxy_ticks += cpu_ticks(proxy.proc.pid) - before
                r = rows[name][-1]
                print(f"run {run:2d} {name:6s} ttft {r['ttft_ms']:8.2f} ms  overhead {r['overhead_ms']:6.2f} ms  "
                      f"TG {r['tg']:7.2f} tok/s", flush=True)
        print(f"config: model={a.model} dtype={a.dtype} threads={a.threads} parallel=1 runs={a.runs} tokens={a.tokens} "
              f"prompt_chars={a.prompt_chars} order=ABBA seed={SEED}")
        med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in rows.items()}
        for name, m in med.items():
            print(f"{name:7s} median ttft {m['ttft_ms']:8.2f} ms  overhead {m['overhead_ms']:6.2f} ms  "
                  f"TG(client) {m['tg']:7.2f} tok/s  TG(server) {m['server_tg']:7.2f} tok/s")
        pairs = list(zip(rows["proxy"], rows["direct"]))
        added = statistics.median(p["overhead_ms"] - d["overhead_ms"] for p, d in pairs)
        raw = statistics.median(p["ttft_ms"] - d["ttft_ms"] for p, d in pairs)
        ratio = statistics.median(p["tg"] / d["tg"] for p, d in pairs)
        print(f"proxy added TTFT, median of paired differences: {added:.2f} ms (overhead), {raw:.2f} ms (raw ttft)")
        print(f"TG through proxy / direct: median of paired ratios {ratio:.4f}, "
              f"ratio of medians {med['proxy']['tg'] / med['direct']['tg']:.4f}")
        tokens = sum(r["chunks"] for r in rows["proxy"])
        ms = proxy_ticks * 1000 / os.sysconf("SC_CLK_TCK")
        print(f"proxy CPU: {ms / a.runs:.2f} ms per request, {ms * 1000 / tokens:.0f} us per relayed token")
        return 0
    finally:
        proxy.kill_all()


if __name__ == "__main__":
    sys.exit(main())
