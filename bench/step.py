"""`python -m bench.step`: where one decode step's time goes, per weight format.

    python -m bench.step [-m default] [--dtypes int8 auto] [--context 128] [--reps 40] [--verify 3] [-t 2]

For each format it loads the engine, measures its decode step on bench.formats' TG workload, and
times the step's parts alone on the model's own weights and cache, one row as at batch 1: each kind
of linear layer over all layers that have it, attention over --context cached positions, the
decoder layers as the engine runs them (one kernel call), and the lm_head (on the families whose
decode step is one kernel call; on the others, the linear layers alone); and a whole step's
forward and logits for a decode row against a verify row of 1 + --verify tokens, their ratio the
cost of verifying drafts. What the step takes beyond the layers and
the lm_head is the embedding, the final norm, sampling, scheduling and Python. Parts are medians of
--reps calls, the formats alternating call by call, so that the shared host's drift hits them alike;
bytes are the weights a part reads once per token. A part timed per layer from Python (a kind of
linear layer, attention) includes a torch op dispatch per layer, a few microseconds each, which the
layers' one call does not pay; the step comes from separate TG runs, so on a drifting host the rest
can even come out negative: compare formats within one run.
"""
from __future__ import annotations

import argparse
import re
import statistics
import time
from collections.abc import Callable

import torch

from engine import Tokenizer
from engine.files.weights import open_model
from engine.model.batch import ForwardBatch, Row
from engine.model.transformer import fused_layers
from engine.ops import kernels
from engine.ops.quant import Linear
from engine.settings import DTYPES

from .formats import TandemSystem, tg_prompts

def weight_bytes(layer: Linear) -> int:
    return sum(t.numel() * t.element_size() for t in (layer.weight, layer.scale, layer.bias) if t is not None)


def linears_by_kind(layers) -> dict[str, list[Linear]]:
    """Every layer's linear layers by name within the layer (self_attn.qkv_proj, linear_attn.in_proj,
    mlp.down_proj, ...): each kind of projection over all layers that have it, every routed expert's
    together (mlp.experts.*.down_proj: more than a token reads, which is its top-k)."""
    kinds: dict[str, list[Linear]] = {}
    for layer in layers:
        for name, module in layer.named_modules():
            if isinstance(module, Linear):
                kinds.setdefault(re.sub(r"experts\.\d+\.", "experts.*.", name), []).append(module)
    return kinds


def step_parts(system: TandemSystem, context: int, verify: int) -> dict[str, tuple[Callable[[], object], int]]:
    """name -> (one call of that part for one token, the weight bytes it reads)."""
    model, cache = system.engine.model, system.engine.cache
    layers = model.layers
    parts = {}
    for name, linears in linears_by_kind(layers).items():
        x = torch.randn(1, linears[0].cols)
        parts[f"linear {name}"] = ((lambda ls=linears, x=x: [kernels.linear_rows(x, l.weight, l.scale, l.bias)
                                                             for l in ls]),
                                   sum(weight_bytes(l) for l in linears))
    hidden = torch.randn(1, model.config.hidden_size)
    residual = torch.randn(1, model.config.residual_width)  # what the layers take: a family's streams side by side
    all_linears = sum(weight_bytes(l) for ls in linears_by_kind(layers).values() for l in ls)
    batch = ForwardBatch.build([Row(0, context, [0])])  # one decode token of slot 0 at position `context`
    rotary = model.config.rotary_dim
    cos, sin = torch.ones(1, rotary), torch.zeros(1, rotary)
    with torch.inference_mode():
        fused = fused_layers(layers, residual, batch, cos, sin, cache) is not None
    if fused:  # the families whose decode step is one call: attention and that call timed alone
        attention = [layer for layer in layers if layer.self_attn is not None]
        a = attention[0].self_attn
        q = torch.randn(1, a.heads, a.head_dim)
        slots, lengths = torch.zeros(1, dtype=torch.long), torch.full((1,), context, dtype=torch.long)
        parts["attention"] = (lambda: [kernels.decode_attention(q, cache.k[layer.index], cache.v[layer.index], slots,
                                                                lengths, a.head_dim ** -0.5) for layer in attention], 0)
        parts["decoder layers (one call)"] = ((lambda: fused_layers(layers, residual, batch, cos, sin, cache)),
                                              all_linears)
        parts["lm_head"] = ((lambda: model.lm_head(hidden)), weight_bytes(model.lm_head))
    # A whole step's forward and logits for one decode row, and for a verify row of 1 + `verify`
    # tokens (the last sampled token and the drafts), both from `context` cached positions.
    for rows in (1, 1 + verify):
        row = ForwardBatch.build([Row(0, context, [0] * rows)])
        parts[f"forward + logits, {rows} row{'s' if rows > 1 else ''}"] = (
            (lambda row=row: model.logits(model(row, cache))), all_linears + weight_bytes(model.lm_head))
    return parts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="default")
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["int8", "auto"])
    p.add_argument("--context", type=int, default=128, help="cached positions the attention reads")
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--tg", type=int, default=128, help="tokens of the measured decode steps")
    p.add_argument("--verify", type=int, default=3, help="drafts in the verify row timed against a decode row")
    p.add_argument("-t", "--threads", type=int)
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    systems = [TandemSystem(args.model, dtype, max(2048, args.context + 1)) for dtype in args.dtypes]
    prompt = tg_prompts(Tokenizer.load(open_model(args.model)), None)[0]
    steps: dict[str, list[float]] = {s.name: [] for s in systems}
    for _ in range(3):
        for s in systems:
            s.tg(prompt, args.tg)
            steps[s.name].append(s.last[0])
    parts = {s.name: step_parts(s, args.context, args.verify) for s in systems}
    times: dict[tuple[str, str], list[float]] = {}
    with torch.inference_mode():
        for _ in range(args.reps):
            for s in systems:
                for part, (call, _) in parts[s.name].items():
                    t0 = time.perf_counter()
                    call()
                    times.setdefault((s.name, part), []).append(1000 * (time.perf_counter() - t0))
    for s in systems:
        step = statistics.median(steps[s.name])
        ms = {part: statistics.median(times[s.name, part]) for part in parts[s.name]}
        print(f"\n{s.name}: decode step {step:.2f} ms ({1000 / step:.1f} tok/s), median of 3 TG runs")
        print(f"{'part':28s} {'ms':>7s} {'of step':>8s} {'MB':>8s} {'GB/s':>6s}")
        for part, (_, nbytes) in parts[s.name].items():
            rate = f"{nbytes / ms[part] / 1e6:6.1f}" if nbytes else ""
            print(f"{part:28s} {ms[part]:7.2f} {ms[part] / step:8.0%} {nbytes / 1e6:8.3f} {rate:>6s}")
        if "lm_head" in ms:
            rest = step - ms["decoder layers (one call)"] - ms["lm_head"]
            print(f"{'rest of the step':28s} {rest:7.2f} {rest / step:8.0%}   (embedding, final norm, sampling, Python)")
        decode, verify = ms["forward + logits, 1 row"], ms[f"forward + logits, {1 + args.verify} rows"]
        print(f"a verify row of 1 + {args.verify} tokens costs {verify / decode:.2f}x a decode row "
              f"({verify:.2f} against {decode:.2f} ms)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
