"""`python -m bench.probe`: what an attention probe costs a prompt, against none and against
transformers' `output_attentions=True`.

    python -m bench.probe [-m default] [--prompt-tokens 512] [--layers 15,29] [--runs 3] [-t 2]

Prompt time (ms, best of `--runs`, one slot, the prompt run whole each time) of tandem f32 with no
probe, with a head_mean probe on the chosen layers for the last token and for every token; then
transformers f32 forward over the same prompt, with its default attention and with eager attention
and output_attentions=True (every layer's full matrix). The engines alternate run by run.
"""
from __future__ import annotations

import argparse
import json
import math
import time

import torch

from bench.formats import load_reference, prompt_tokens
from engine import Engine, EngineConfig, ProbeSpec, SamplingParams

ONE_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def tandem_ms(engine: Engine, ids: list[int], probe: ProbeSpec | None) -> float:
    t0 = time.perf_counter()
    for out in engine.generate(ids, ONE_TOKEN, cache_prompt=False, probe=probe):
        pass
    assert probe is None or out.request.probe_result is not None
    return 1000 * (time.perf_counter() - t0)


@torch.inference_mode()
def transformers_ms(hf, ids: list[int], attentions: bool) -> float:
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    hf(x, output_attentions=attentions)
    return 1000 * (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.probe", description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default="default")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--layers", default="15,29", help="comma-separated trunk layers to probe")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--json", help="write the row here")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    layers = tuple(int(i) for i in a.layers.split(","))
    engine = Engine.load(EngineConfig(model=a.model, dtype="f32", ctx_size=a.prompt_tokens + 16, parallel=1))
    ids = prompt_tokens(engine.tokenizer, a.prompt_tokens)
    sdpa = load_reference(a.model)
    eager = load_reference(a.model)
    eager.set_attn_implementation("eager")
    runs = {
        "tandem_no_probe_ms": lambda: tandem_ms(engine, ids, None),
        "tandem_probe_last_ms": lambda: tandem_ms(engine, ids, ProbeSpec(layers)),
        "tandem_probe_all_ms": lambda: tandem_ms(engine, ids, ProbeSpec(layers, query="all")),
        "transformers_ms": lambda: transformers_ms(sdpa, ids, False),
        "transformers_output_attentions_ms": lambda: transformers_ms(eager, ids, True),
    }
    best = {name: math.inf for name in runs}
    for _ in range(a.runs):
        for name, measure in runs.items():
            best[name] = min(best[name], measure())
    row = {"model": a.model, "prompt_tokens": a.prompt_tokens, "layers": list(layers), "threads": a.threads,
           **{name: round(ms, 1) for name, ms in best.items()}}
    print(json.dumps(row), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
