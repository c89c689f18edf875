"""`python -m bench.pipeline`: what splitting the trunk costs. TG at batch 1 and the aggregate TG of
4 streams on 4 slots, through HTTP, for the model unsplit, split into two stages in one process
(`--devices cpu,cpu`) and split over two processes (`-pp 2`, each with --threads threads), in
alternating runs; prints medians and each split's ratio to unsplit.

    python -m bench.pipeline [--model default] [--runs 3] [--tokens 64] [--threads 2] [--dtype f32]

Workload: bench.server_tg's (prompt "Once upon a time", greedy, ignore_eos, fixed length).
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

from bench.processes import ServerProcess
from bench.server_tg import http_tg

SPLITS = {"unsplit": [], "devices cpu,cpu": ["--devices", "cpu,cpu"], "-pp 2": ["-pp", "2"]}


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.pipeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="f32")
    a = ap.parse_args()
    print(f"model {a.model} {a.dtype}, {a.tokens} tokens, greedy, -np 4, threads={a.threads} per process, "
          f"runs={a.runs}")
    logs = Path(tempfile.mkdtemp())
    flags = ["-m", a.model, "-t", str(a.threads), "--dtype", a.dtype, "-np", "4", "-c", "8192"]
    servers = {name: ServerProcess([*flags, *extra], logs / f"{i}.log") for i, (name, extra) in enumerate(SPLITS.items())}
    try:
        for server in servers.values():
            server.wait_ready()
            http_tg(server.url, 8, 1)  # warm-up
        rows: dict[str, list[float]] = {f"{name} {shape}": [] for name in servers for shape in ("b1", "x4 aggregate")}
        for run in range(a.runs):
            for name, server in servers.items():
                rows[f"{name} b1"].append(http_tg(server.url, a.tokens, 1)[0])
                rows[f"{name} x4 aggregate"].append(http_tg(server.url, a.tokens, 4)[0])
            print(f"run {run}: " + json.dumps({k: round(v[-1], 2) for k, v in rows.items()}), flush=True)
        med = {k: statistics.median(v) for k, v in rows.items()}
        for k, v in med.items():
            print(f"median {k}: {v:.2f} tok/s")
        for name in list(servers)[1:]:
            for shape in ("b1", "x4 aggregate"):
                print(f"{name} / unsplit, {shape}: {med[f'{name} {shape}'] / med[f'unsplit {shape}']:.3f}")
    finally:
        for server in servers.values():
            server.kill()


if __name__ == "__main__":
    main()
