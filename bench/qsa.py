"""`python -m bench.qsa`: what QSA layers cost and save on a model, against dense attention.

    python -m bench.qsa quality [-m default] [--tokens 8192] [--patterns every4:4 all:4] [--budgets 256 512 1024]
    python -m bench.qsa speed [-m default] [--dtype int8] [--contexts 1024 4096 8192] [--budget 512] [--runs 3]

quality: perplexity over the first `--tokens` tokens of plain English (GPL-3, as bench.formats), in
chunks of 512 from an empty cache, for dense and each pattern and budget; then the greedy tokens of
256 steps after a 4,096-token prompt of the same text, compared with dense's (positions before the
first difference, and the share of equal positions). The default model was trained dense, so QSA
is an approximation of it here: these figures say how close, not how good a QSA-trained model is.

speed: decode step time (ms, median over steps, best of `--runs`) after a prompt of each context
length, dense against `all:4` at the budget, alternating the two engines run by run. A model with
its own QSA indexer (Qwen4-Exp) runs as it is against `--compress-ratios none`, its dense twin.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import torch

from bench.formats import prompt_tokens
from engine import CompressRatios, Engine, EngineConfig, SamplingParams
from engine.files.weights import open_model
from engine.model.batch import ForwardBatch, Row
from engine.model.kv_cache import KVCache

CHUNK = 512


def load(model: str, dtype: str, ctx: int, pattern: str | None, budget: int | None) -> Engine:
    ratios = CompressRatios.parse(pattern) if pattern else None
    return Engine.load(EngineConfig(model=model, dtype=dtype, ctx_size=ctx, compress_ratios=ratios, qsa_budget=budget))


@torch.inference_mode()
def perplexity(engine: Engine, ids: list[int]) -> float:
    model, c = engine.model, engine.model.config
    cache = KVCache(c.num_layers, 1, len(ids), c.num_kv_heads, c.head_dim, model.compute_dtype, specs=model.specs)
    nll, n = 0.0, 0
    for start in range(0, len(ids) - 1, CHUNK):
        chunk = ids[start:start + CHUNK]
        logits = model.logits(model(ForwardBatch.build([Row(0, start, chunk)]), cache))
        targets = torch.tensor(ids[start + 1:start + 1 + len(chunk)])
        logp = torch.log_softmax(logits[:len(targets)], -1)
        nll -= float(logp[torch.arange(len(targets)), targets].sum())
        n += len(targets)
    return math.exp(nll / n)


def greedy(engine: Engine, ids: list[int], n: int) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return list(engine.generate(ids, params, cache_prompt=False))[-1].request.output_ids


def quality(a) -> list[dict]:
    configs = [(None, None)] + [(p, b) for p in a.patterns for b in a.budgets]
    rows, reference = [], None
    for pattern, budget in configs:
        engine = load(a.model, "f32", max(a.tokens, 4096 + 256), pattern, budget)
        ids = prompt_tokens(engine.tokenizer, a.tokens)
        ppl = perplexity(engine, ids)
        tokens = greedy(engine, ids[:4096], 256)
        reference = tokens if reference is None else reference
        first = next((i for i, (x, y) in enumerate(zip(tokens, reference)) if x != y), len(tokens))
        same = sum(x == y for x, y in zip(tokens, reference)) / len(tokens)
        row = {"ratios": pattern or "dense", "budget": budget, "perplexity": round(ppl, 3),
               "greedy_same_until": first, "greedy_same_share": round(same, 3)}
        print(json.dumps(row), flush=True)
        rows.append(row)
        del engine
    return rows


def step_ms(engine: Engine, ids: list[int], steps: int) -> float:
    """Median time of one decode step after prefilling `ids`."""
    params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    stamps = [time.perf_counter() for out in engine.generate(ids, params, cache_prompt=False) if out.token_ids]
    return 1000 * statistics.median(b - a for a, b in zip(stamps, stamps[1:]))


def speed(a) -> list[dict]:
    ctx = max(a.contexts) + a.steps + 8
    indexer = open_model(a.model).config.indexer
    budget = a.budget if indexer is None else indexer.budget
    if indexer is not None:  # its own QSA against its dense twin
        engines = {"dense": load(a.model, a.dtype, ctx, "none", None), "indexer": load(a.model, a.dtype, ctx, None, None)}
    else:
        engines = {"dense": load(a.model, a.dtype, ctx, None, None),
                   "all:4": load(a.model, a.dtype, ctx, "all:4", a.budget)}
    ids = prompt_tokens(engines["dense"].tokenizer, max(a.contexts))
    rows = []
    for context in a.contexts:
        best = {name: math.inf for name in engines}
        for _ in range(a.runs):
            for name, engine in engines.items():
                best[name] = min(best[name], step_ms(engine, ids[:context], a.steps))
        row = {"context": context, "dtype": a.dtype, "budget": budget,
               **{f"{name}_step_ms": round(ms, 2) for name, ms in best.items()}}
        print(json.dumps(row), flush=True)
        rows.append(row)
    for name in engines:
        growth = rows[-1][f"{name}_step_ms"] - rows[0][f"{name}_step_ms"]
        print(f"{name}: step time grows {growth:.2f} ms from {a.contexts[0]} to {a.contexts[-1]} positions")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.qsa", description=__doc__.split("\n\n")[0])
    ap.add_argument("what", choices=["quality", "speed"])
    ap.add_argument("-m", "--model", default="default")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--patterns", nargs="+", default=["every4:4", "all:4"])
    ap.add_argument("--budgets", nargs="+", type=int, default=[256, 512, 1024])
    ap.add_argument("--dtype", default="int8")
    ap.add_argument("--contexts", nargs="+", type=int, default=[1024, 4096, 8192])
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", help="write the rows here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = quality(a) if a.what == "quality" else speed(a)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
