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

    python -m bench.compare --http [--llama-server PATH] [--dtype f32 int8] [--runs 3] [--tg 128] [--lanes 1]
                            [--temperature 0] [--prompts configs/prompts/open-chat.json] [--main]
                            [--spec-type draft-mtp draft-mtp-ngram] [-md DRAFT [DRAFT ...]] [--spec-draft-width 1 [2 ...]]
                            [--document /usr/share/common-licenses/GPL-3 --document-tokens 5200] [--busy 1]
                            [--also FLAGS [FLAGS ...]]

--http: the servers instead, as a user meets them (bench/served.py): for each dtype, tandem's
server plain and with the MTP draft (--main: also the main command as it ships, `python -m server
-m default`, whatever its lanes), and llama.cpp's own C++ llama-server on the same GGUF file
(--llama-server PATH; by default the build docs/benchmarks.md's recipe, "The anchor", leaves
under ~/.cache/tandem-anchors), or where none is built,
llama-cpp-python's Python server, labelled as the fallback it is; every run sends
each prompt of the file (chat prompts on tasks the draft never saw, chat-templated once and sent as
the same text to all) to each server in turn, prompt by prompt, the first server a different one
for each prompt, up to --tg tokens or the end of text. A run's TG is
its tokens over its generating time; the table gives medians over runs, ratios to each system's
plain twin and to llama.cpp's server, and accepted/drafted tokens. Several drafts (-md A B) are
served side by side in the same runs, each row named by its path: an A/B of drafts on one host state;
so are several widths (--spec-draft-width 1 2: chains against trees with one sibling per depth).
--document: long prompts, each prompt of the file preceded by --document-tokens tokens of the
document, from a different place for each prompt and run (so no server finds one in its prompt
cache); the table then also gives PP, the prompt tokens each server reports over the wait for its
first chunk.
--busy N: N processes spinning at nice 19 beside the servers while they are measured. --also FLAGS:
each drafting tandem server once more with FLAGS added, in the same runs (an A/B of a flag).
"""
from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import served
from bench.processes import BusyLoops
from bench.formats import TandemSystem, TransformersSystem, add_workload_flags, run, table, tokens_per_second, workload
from engine import SpecConfig, Tokenizer, cpu
from engine.files.model_config import num_param_bytes
from engine.files.weights import open_model
from engine.ops.quant import BYTES_PER_WEIGHT
from engine.settings import DEFAULT_DRAFT, DTYPES

LLAMA_CPP = "llama.cpp"
# Where docs/benchmarks.md's recipe ("The anchor") builds llama.cpp's C++ server.
ANCHOR = Path.home() / ".cache/tandem-anchors/llama-cpp-python-0.3.36/src/vendor/llama.cpp/build/bin/llama-server"
MAIN_COMMAND = "tandem main command"
OPEN_CHAT = Path(__file__).parents[1] / "configs/prompts/open-chat.json"


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
    p.add_argument("--dtype", nargs="+", choices=DTYPES, default=["f32"], help="tandem's weight formats")
    p.add_argument("-md", "--spec-draft-model", nargs="+",
                   help="MTP draft (default: the committed draft, for the default model); --http takes several, "
                        "each served beside the others in the same runs")
    p.add_argument("--spec-draft-n-max", type=int, default=3)
    p.add_argument("--spec-draft-p-min", type=float, default=0.5, help="the MTP draft's confidence floor")
    p.add_argument("--spec-draft-width", type=int, nargs="+", default=[1],
                   help="candidates per draft depth (1: a chain); --http takes several, served side by side")
    p.add_argument("--spec-draft-p-sibling", type=float, default=0.1, help="a sibling's least draft probability")
    p.add_argument("--http", action="store_true", help="compare the servers over HTTP (see above)")
    p.add_argument("--prompts", type=Path, default=OPEN_CHAT, help="--http: a JSON file with a 'prompts' list")
    p.add_argument("--lanes", type=int, default=1, help="--http: requests at once (and slots per tandem server)")
    p.add_argument("--temperature", type=float, default=0.0, help="--http: sampling temperature")
    p.add_argument("--spec-type", nargs="+", choices=["draft-mtp", "draft-mtp-ngram"], default=["draft-mtp"],
                   help="--http: the drafters each dtype is served with, beside plain")
    p.add_argument("--llama-server", type=Path, default=ANCHOR if ANCHOR.is_file() else None,
                   help="--http: llama.cpp's C++ llama-server binary to compare with (default: %(default)s)")
    p.add_argument("--main", action="store_true", help="--http: also serve the main command as it ships")
    p.add_argument("--document", type=Path, help="--http: a text file whose tokens precede each prompt (see above)")
    p.add_argument("--document-tokens", type=int, default=5200, help="--http: how many of the document's tokens")
    p.add_argument("--busy", type=int, default=0, help="--http: processes spinning at nice 19 meanwhile")
    p.add_argument("--json-schema", type=Path, metavar="FILE",
                   help="--http: also run each system with every answer held to this JSON schema (llama-server's "
                        "json_schema field; e.g. configs/schemas/answer.json), on the same server, in the same turn")
    p.add_argument("--grammar", type=Path, metavar="FILE",
                   help="--http: likewise with this GBNF grammar (the grammar field; configs/grammars/any-text.gbnf "
                        "refuses nothing: the answers are the free ones, and the difference is the constraint's cost)")
    p.add_argument("--also", nargs="+", default=[], metavar="FLAGS",
                   help="--http: each drafting server again with these flags too (an A/B: --also=--no-spec-pacing)")
    args = p.parse_args(argv)
    if args.http:
        return http_main(args)
    if args.spec_draft_model and len(args.spec_draft_model) > 1:
        p.error(f"--spec-draft-model: {len(args.spec_draft_model)} drafts given; only --http compares several")
    if len(args.spec_draft_width) > 1:
        p.error(f"--spec-draft-width: {len(args.spec_draft_width)} widths given; only --http compares several")
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    files = open_model(args.model)
    draft = next(iter(drafts_of(args)), None)
    pp_ids, prompts, ctx = workload(args)
    systems = []
    for dtype in args.dtype:
        systems.append(TandemSystem(args.model, dtype, ctx))
        if draft:
            systems.append(TandemSystem(args.model, dtype, ctx,
                                        SpecConfig(type="draft-mtp", draft_model=draft, n_max=args.spec_draft_n_max,
                                                   p_min=args.spec_draft_p_min, width=args.spec_draft_width[0],
                                                   p_sibling=args.spec_draft_p_sibling)))
        systems.append(TandemSystem(args.model, dtype, ctx, SpecConfig(type="ngram-simple", n_max=args.spec_draft_n_max,
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
    print(f"model {args.model} ({files.path.name}), tandem {' '.join(args.dtype)}, PP {args.pp} tokens, TG {args.tg} tokens "
          f"at batch 1, greedy, {threads} threads, {args.runs} runs", flush=True)
    results = run(systems, pp_ids, prompts, args.tg, args.runs, log=lambda line: print(line, flush=True))
    print(f"\nmedians, {cpu.describe()}:\n" + table(results, [TransformersSystem.NAME, LLAMA_CPP]))
    print(f"\nmemory bandwidth (1 GiB copy, {threads} threads): {bandwidth / 1e9:.1f} GB/s")
    for dtype in (d for d in DTYPES if d != "auto"):
        nbytes = num_param_bytes(files.config, BYTES_PER_WEIGHT[dtype])
        print(f"TG ceiling at batch 1, {dtype} weights ({nbytes / 1e6:.0f} MB per token): "
              f"{bandwidth / nbytes:.1f} tok/s")
    lengths = {r.system: statistics.median(r.accept_length) for r in results if r.accept_length and " + " in r.system}
    for name, length in lengths.items():
        print(f"{name}: {length:.2f} tokens per verify step (median over runs)")
    return 0


def drafts_of(args: argparse.Namespace) -> list[str]:
    """The MTP drafts to serve: those named, else the committed draft for the default model."""
    return args.spec_draft_model or ([str(DEFAULT_DRAFT)] if args.model == "default" else [])


def http_main(args: argparse.Namespace) -> int:
    files = open_model(args.model)
    if files.path.suffix != ".gguf":
        print(f"--http compares with llama.cpp's server, which needs a GGUF file; {files.path} is not one")
        return 2
    if args.llama_server is not None and not args.llama_server.is_file():
        print(f"--llama-server {args.llama_server}: no such file")
        return 2
    if args.llama_server is None and importlib.util.find_spec("llama_cpp") is None:
        print("--http needs llama.cpp's server: build the C++ llama-server (docs/benchmarks.md, \"The anchor\"; "
              "about 15 minutes) and pass --llama-server PATH")
        return 2
    threads = args.threads or torch.get_num_threads()
    tokenizer = Tokenizer.load(files)
    messages = json.loads(args.prompts.read_text())["prompts"]

    def texts_of(run: int) -> list[str]:
        """Run `run`'s prompts, chat-templated (the warm-up's: run -1); with --document, each run's
        from new places in it, so that no server finds a prompt of an earlier run cached."""
        asked = messages if not args.document else \
            with_document(tokenizer, document, args.document_tokens, messages, (run + 1) * len(messages))
        return [tokenizer.apply_chat_template([{"role": "user", "content": m}]) for m in asked]
    document = args.document.read_text() if args.document else ""
    runs = [texts_of(i) for i in range(-1, args.runs)]
    ctx = max(len(tokenizer.encode(t)) for run in runs for t in run) + args.tg + 1
    drafts = drafts_of(args)
    limits = ["--spec-draft-n-max", str(args.spec_draft_n_max), "--spec-draft-p-min", str(args.spec_draft_p_min),
              "--spec-draft-p-sibling", str(args.spec_draft_p_sibling)]
    with tempfile.TemporaryDirectory(prefix="bench-http-") as tmp:
        logs = Path(tmp)
        systems = []
        busy = BusyLoops(args.busy)
        try:  # a server process starts when it is made: any failure from here on stops those made
            for dtype in args.dtype:
                base = ["-m", args.model, "--dtype", dtype, "-c", str(ctx * args.lanes), "-np", str(args.lanes)]
                systems.append(served.TandemServer(f"tandem {dtype}", [*base, "--spec-type", "none"], threads, logs))
                for draft, width in itertools.product(drafts, args.spec_draft_width):
                    # Named by the path as given and the width only when several are compared; the
                    # plain twin is the name before " + ".
                    tag = (f" ({draft})" if len(drafts) > 1 else "") + \
                        (f" w={width}" if len(args.spec_draft_width) > 1 else "")
                    for kind, extra in itertools.product(args.spec_type, ["", *args.also]):
                        command = [*base, "--spec-type", kind, "-md", draft, *limits,
                                   "--spec-draft-width", str(width), *shlex.split(extra)]
                        name = f"tandem {dtype} + {kind}{tag}" + (f" {extra}" if extra else "")
                        systems.append(served.TandemServer(name, command, threads, logs))
            if args.main:
                # As it ships, but for a context that holds --document's prompts (its pool is shared).
                grown = ["-c", str(2 * ctx)] if args.document else []
                systems.append(served.TandemServer(MAIN_COMMAND, ["-m", args.model, *grown], threads, logs))
            if args.llama_server is not None:
                systems.append(served.LlamaServer(args.llama_server, files.path, ctx, args.lanes, threads, logs))
            else:
                systems.append(served.LlamaCppServer(files.path, ctx, args.lanes, threads, logs))
            for s in systems:
                s.start()
            held = ([({"json_schema": json.loads(args.json_schema.read_text())}, args.json_schema.name)]
                    if args.json_schema else []) + \
                ([({"grammar": args.grammar.read_text()}, args.grammar.name)] if args.grammar else [])
            systems += [served.Constrained(s, fields, label) for fields, label in held for s in systems]
            print(f"model {args.model} ({files.path.name}), {len(messages)} prompts from {args.prompts.name}, up to "
                  f"{args.tg} tokens, temperature {args.temperature:g}, {args.lanes} lane(s), {threads} threads, "
                  f"{args.runs} runs" + (f", {args.busy} busy loop(s) beside" if args.busy else ""), flush=True)
            busy.start()
            for s in systems:  # warm-up
                served.measure(s, runs[0][:args.lanes], 8, args.temperature, args.lanes, seed=0)
            series = [served.Series(s.name) for s in systems]
            for i in range(args.runs):
                samples = [served.Sample(0, 0.0) for _ in systems]
                # Prompt by prompt (a lane's worth at a time), every system in turn, each group
                # starting one system later: a slow spell of the host falls on all of them alike.
                for g, start in enumerate(range(0, len(messages), args.lanes)):
                    for k in range(len(systems)):
                        j = (g + k) % len(systems)
                        samples[j].add(served.measure(systems[j], runs[i + 1][start:start + args.lanes], args.tg,
                                                      args.temperature, args.lanes, seed=i))
                for s, r, sample in zip(systems, series, samples):
                    r.tg.append(sample.tg)
                    r.drafted += sample.drafted
                    r.accepted += sample.accepted
                    if sample.prompt_tokens:
                        r.pp.append(sample.pp)
                    print(f"run {i + 1}/{args.runs} {s.name:28s} TG {sample.tg:6.1f} tok/s ({sample.tokens} tokens)"
                          + (f", PP {sample.pp:7.1f} tok/s" if sample.prompt_tokens else ""), flush=True)
        finally:
            busy.stop()
            for s in systems:
                s.stop()
    print(f"\nmedians, {cpu.describe()}:\n" + served_table(series))
    if args.json_schema or args.grammar:
        print("\nheld to a grammar, against the same system free:\n" + held_table(series))
    return 0


def held_table(series: list["served.Series"]) -> str:
    """Each system held to a grammar against itself free: TG, and how often its drafts were kept."""
    by_name = {r.system: r for r in series}
    width = max(len(r.system) for r in series)
    lines = [f"{'system':{width}s} {'TG tok/s':>9s} {'/free':>6s} {'accepted/drafted':>17s} {'free':>6s}"]
    for r in series:
        free = by_name.get(r.system.split(" [")[0])
        if free is r or free is None:
            continue
        rate = f"{r.accepted / r.drafted:.2f}" if r.drafted else ""
        free_rate = f"{free.accepted / free.drafted:.2f}" if free.drafted else ""
        lines.append(f"{r.system:{width}s} {r.tg_median:9.1f} {r.tg_median / free.tg_median:5.2f}x "
                     f"{f'{r.accepted}/{r.drafted} = {rate}' if rate else '':>17s} {free_rate:>6s}")
    return "\n".join(lines)


def with_document(tokenizer, document: str, n: int, messages: list[str], first: int = 0) -> list[str]:
    """Each message after n tokens of the document, message i's from token 97 * (first + i) on (the
    document repeated where it is shorter): fresh prompts that share no prefix."""
    ids = tokenizer.encode(document)
    ids = ids * (1 + (n + 97 * (first + len(messages))) // len(ids))
    return [f"{tokenizer.decode(ids[97 * k:97 * k + n])}\n\n{m}" for k, m in enumerate(messages, first)]


def served_table(series: list["served.Series"]) -> str:
    """TG medians, against each system's plain twin and llama.cpp's server; PP where measured."""
    by_name = {r.system: r for r in series}
    llama = by_name.get(served.LlamaServer.NAME) or by_name.get(served.LlamaCppServer.NAME)
    width = max(28, *(len(r.system) for r in series))
    against = "/" + (llama.system.split()[0] if llama else "llama.cpp")
    w = max(10, len(against))
    pp = any(r.pp for r in series)

    def versus(r, value) -> str:
        return f"{value(r) / value(llama):{w - 1}.2f}x" if llama and value(llama) else f"{'-':>{w}s}"

    head = f"{'system':{width}s} {'TG tok/s':>9s} {'/plain':>7s} {against:>{w}s} {'accepted/drafted':>17s}"
    lines = [head + (f" {'PP tok/s':>9s} {against:>{w}s}" if pp else "")]
    for r in series:
        plain = by_name.get(r.system.split(" + ")[0])
        own = f"{r.tg_median / plain.tg_median:6.2f}x" if plain is not r and plain else f"{'':7s}"
        rate = f"{r.accepted}/{r.drafted} = {r.accepted / r.drafted:.2f}" if r.drafted else ""
        line = f"{r.system:{width}s} {r.tg_median:9.1f} {own} {versus(r, lambda x: x.tg_median)} {rate:>17s}"
        lines.append(line + (f" {r.pp_median:9.1f} {versus(r, lambda x: x.pp_median)}" if pp else ""))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
