"""`python -m bench.compare`: tandem side by side with transformers and llama.cpp on the same model,
in one process, runs alternating between systems (A B C A B C ...), medians and ratios.

    python -m bench.compare [-m default] [--dtype f32] [--runs 5] [--pp 512] [--tg 128] [--heldout 5]
                            [--message TEXT|@FILE] [--spec-draft-n-max 3] [--spec-draft-p-min 0.5]

Systems: tandem without speculation, with the MTP draft (-md; the committed draft for the default
model), with ngram; transformers' generate() in fp32 on the same weights, plain and with prompt
lookup; llama.cpp through llama-cpp-python on the same GGUF file, when that package is installed
(`pip install llama-cpp-python`: it compiles llama.cpp, which takes minutes). The workload and the
timing are those of bench.formats. It also measures the machine's memory bandwidth and prints the
TG ceiling it allows at batch 1, where every weight is read once per token.
"""
from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import time
from pathlib import Path

import torch

from bench.formats import TandemSystem, TransformersSystem, add_workload_flags, run, table, tokens_per_second, workload
from engine.config import num_param_bytes
from engine.drafter import SpecConfig
from engine.quant import BYTES_PER_WEIGHT, DTYPES
from engine.weights import open_model

DEFAULT_DRAFT = Path(__file__).parents[1] / "configs/drafts/smollm2-135m-mtp.safetensors"
LLAMA_CPP = "llama.cpp"


class LlamaCppSystem:
    """llama.cpp on the same GGUF file, greedy; end of text is not a stop, as for the others."""

    def __init__(self, gguf: Path, ctx: int, threads: int):
        from llama_cpp import Llama
        self.name = LLAMA_CPP
        self.llm = Llama(model_path=str(gguf), n_ctx=ctx, n_threads=threads, n_threads_batch=threads, n_batch=512,
                         verbose=False)

    def pp(self, ids: list[int]) -> float:
        self.llm.reset()
        t0 = time.perf_counter()
        self.llm.eval(ids)
        return len(ids) / (time.perf_counter() - t0)

    def tg(self, ids: list[int], n: int) -> float:
        self.llm.reset()
        stamps = []
        for _ in self.llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, reset=False):  # greedy
            stamps.append(time.perf_counter())
            if len(stamps) == n:
                break
        return tokens_per_second(stamps)


def memory_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy (read + write), best of `repeats`, with torch's threads."""
    src = torch.ones(int(gib * 2**30) // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_flags(p, heldout=5)
    p.add_argument("--dtype", choices=DTYPES, default="f32", help="tandem's weight format")
    p.add_argument("-md", "--spec-draft-model", help="MTP draft (default: the committed draft, for the default model)")
    p.add_argument("--spec-draft-n-max", type=int, default=3)
    p.add_argument("--spec-draft-p-min", type=float, default=0.5, help="the MTP draft's confidence floor")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    files = open_model(args.model)
    draft = args.spec_draft_model or (str(DEFAULT_DRAFT) if args.model == "default" else None)
    pp_ids, prompts, ctx = workload(args)
    systems = [TandemSystem(args.model, args.dtype, ctx)]
    if draft:
        systems.append(TandemSystem(args.model, args.dtype, ctx,
                                    SpecConfig(type="draft-mtp", draft_model=draft, n_max=args.spec_draft_n_max,
                                               p_min=args.spec_draft_p_min)))
    systems.append(TandemSystem(args.model, args.dtype, ctx, SpecConfig(type="ngram-simple", n_max=args.spec_draft_n_max,
                                                                       p_min=0.0)))
    hf = TransformersSystem(args.model)
    systems += [hf, TransformersSystem(args.model, f"{hf.name} + prompt lookup", hf.model,
                                       prompt_lookup_num_tokens=args.spec_draft_n_max)]
    if files.path.suffix != ".gguf":
        print("llama.cpp: skipped (the model is not a GGUF file)")
    elif importlib.util.find_spec("llama_cpp") is None:
        print("llama.cpp: skipped (install it with `pip install llama-cpp-python`; it compiles for minutes)")
    else:
        systems.append(LlamaCppSystem(files.path, ctx, threads))
    bandwidth = memory_bandwidth()
    print(f"model {args.model} ({files.path.name}), tandem {args.dtype}, PP {args.pp} tokens, TG {args.tg} tokens "
          f"at batch 1, greedy, {threads} threads, {args.runs} runs", flush=True)
    results = run(systems, pp_ids, prompts, args.tg, args.runs, log=lambda line: print(line, flush=True))
    print("\nmedians:\n" + table(results, [TransformersSystem.NAME, LLAMA_CPP]))
    print(f"\nmemory bandwidth (1 GiB copy, {threads} threads): {bandwidth / 1e9:.1f} GB/s")
    for dtype, per_weight in BYTES_PER_WEIGHT.items():
        nbytes = num_param_bytes(files.config, per_weight)
        print(f"TG ceiling at batch 1, {dtype} weights ({nbytes / 1e6:.0f} MB per token): "
              f"{bandwidth / nbytes:.1f} tok/s")
    lengths = {r.system: statistics.median(r.accept_length) for r in results if r.accept_length and " + " in r.system}
    for name, length in lengths.items():
        print(f"{name}: {length:.2f} tokens per verify step (median over runs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
