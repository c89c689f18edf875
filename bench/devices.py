"""`python -m bench.devices`: what splitting the trunk costs, in one process or over several: TG at
batch 1 and the aggregate TG of 4 slots, the unsplit model against each placement and each -pp size
asked for, in alternating runs; prints medians and each split's ratio to unsplit, and first whether
each split's greedy tokens equal the unsplit model's (on a GPU: `--placements cuda:0,cpu cuda:0`).

    python -m bench.devices [-m default] [--placements cpu,cpu ...] [--pp 2 ...] [--runs 5] [--tokens 64]
                            [--threads 2] [--dtype f32]

A placement is DEVICES[/SPLIT], as --devices and --layer-split spell them: `cpu,cpu` (layers split
evenly) or `cpu,cpu/10,20`. Two CPU stages in one process share one thread pool, so on the CPU a
split can only cost (docs/architecture.md, "Devices and stages"); this measures how much. With
`--pp N` this process is the head of N processes (docs/architecture.md, "Pipeline parallelism"),
each worker started as the server would start it, with --threads threads of its own.

Workload: prompt "Once upon a time" (4 numbered variants for the slots), greedy, ignore_eos, fixed
length. Aggregate TG: tokens after each request's first, over the time from the first first token
to the last request's end.
"""
from __future__ import annotations

import argparse
import json
import statistics
import threading

from bench.server_tg import PROMPT, engine_tg

SLOTS = 4


def aggregate_tg(engine, tokens: int) -> float:
    """Tokens per second of SLOTS requests generated together (on the engine's thread)."""
    from engine import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    done = threading.Semaphore(0)
    requests = [engine.submit(engine.tokenizer.encode(f"{PROMPT} ({i})"), params,
                              lambda out: out.finished and done.release(), cache_prompt=False) for i in range(SLOTS)]
    for _ in requests:
        done.acquire()
    start = min(r.t_first_token for r in requests)
    end = max(r.t_finished for r in requests)
    return sum(len(r.output_ids) - 1 for r in requests) / (end - start)


def greedy_tokens(engine, tokens: int) -> list[int]:
    from engine import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    return [t for out in engine.generate(engine.tokenizer.encode(PROMPT), params, cache_prompt=False)
            for t in out.token_ids]


def parse_placement(text: str) -> tuple[tuple[str, ...], tuple[int, ...] | None]:
    from engine.placement import parse_devices, parse_layer_split
    devices, _, split = text.partition("/")
    return parse_devices(devices), parse_layer_split(split) if split else None


def pipeline_engine(a: argparse.Namespace, stages: int):
    """This process as the head of a -pp pipeline, with its workers (started here, the main thread)."""
    from engine import Engine, EngineConfig
    from engine.pipeline.ranks import LocalWorkers
    workers = LocalWorkers(["-m", a.model, "--dtype", a.dtype, "-c", str(SLOTS * 1024), "-np", str(SLOTS),
                            "-t", str(a.threads), "-pp", str(stages), "--spec-type", "none"], stages)
    config = EngineConfig(model=a.model, dtype=a.dtype, ctx_size=SLOTS * 1024, parallel=SLOTS, threads=a.threads,
                          pipeline_parallel_size=stages)
    return Engine.load(config, rank=workers.rank, describe_loss=workers.describe_loss), workers


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.devices", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="default")
    ap.add_argument("--placements", nargs="+", default=["cpu,cpu"], help="DEVICES[/SPLIT] each")
    ap.add_argument("--pp", nargs="*", type=int, default=[2], help="-pp sizes (processes) to measure")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="f32")
    a = ap.parse_args(argv)
    import torch

    from engine import Engine, EngineConfig
    torch.set_num_threads(a.threads)
    print(f"{a.model} {a.dtype}, prompt {PROMPT!r}, {a.tokens} tokens, greedy, threads={a.threads}, runs={a.runs}")
    engines = {"unsplit": None, **{p: parse_placement(p) for p in a.placements}}
    for name, placement in engines.items():
        devices, split = placement or (("cpu",), None)
        engines[name] = Engine.load(EngineConfig(model=a.model, dtype=a.dtype, ctx_size=SLOTS * 1024, parallel=SLOTS,
                                                 threads=a.threads, devices=devices, layer_split=split))
        engines[name].start()
        print(f"{name}: stages of {[len(s.layers) for s in engines[name].model.stages]} layers", flush=True)
    workers = []
    for stages in a.pp:
        engines[f"-pp {stages}"], started = pipeline_engine(a, stages)
        engines[f"-pp {stages}"].start()
        workers.append(started)
    greedy = {name: greedy_tokens(engine, a.tokens) for name, engine in engines.items()}  # also the warm-up
    for name in list(engines)[1:]:
        same = greedy[name] == greedy["unsplit"]
        print(f"{name}: greedy tokens {'equal' if same else 'DIFFER from'} unsplit's"
              + ("" if same else f" ({greedy[name]} vs {greedy['unsplit']})"), flush=True)
    rows: dict[str, list[float]] = {}
    for run in range(a.runs):
        for name, engine in engines.items():
            rows.setdefault(f"{name} b1", []).append(engine_tg(engine, a.tokens))
            rows.setdefault(f"{name} x{SLOTS} aggregate", []).append(aggregate_tg(engine, a.tokens))
        print(f"run {run}: " + json.dumps({k: round(v[-1], 2) for k, v in rows.items()}), flush=True)
    med = {k: statistics.median(v) for k, v in rows.items()}
    for k, v in med.items():
        print(f"median {k}: {v:.2f} tok/s")
    for name in list(engines)[1:]:
        for kind in ("b1", f"x{SLOTS} aggregate"):
            print(f"{name} / unsplit, {kind}: {med[f'{name} {kind}'] / med[f'unsplit {kind}']:.3f}")
    for engine in engines.values():
        engine.stop()
    for started in workers:
        started.stop()


if __name__ == "__main__":
    main()
