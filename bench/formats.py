"""`python -m bench.formats`: prompt processing (PP) and token generation (TG) speed of the engine at
each weight format against transformers' generate() in fp32, on the same model, in one run.

    python -m bench.formats [--dtypes f32 bf16 int8 auto] [--runs 5] [--pp 512] [--tg 128] [--threads N]
    python -m bench.formats --dtypes f32 int8 --spec-type draft-mtp -md default \
        --heldout 5 --no-transformers

Every run measures each system once, in turn (alternating, so that a noisy neighbour hurts all of
them alike), and the table gives medians over runs and each median's ratio to transformers.
PP: a prompt of `--pp` tokens of plain English (GPL-3), prefilled from an empty cache.
TG: `--tg` tokens at batch 1 after a short chat prompt, greedy, end of text ignored; timed from the
first generated token to the last, so prefill is not in it.

With `--spec-type`, each dtype runs once without and once with the drafter, and the table adds what
bounds the speedup: the mean acceptance length L (tokens per verify step), the verify cost (a
verify step's target forward over a plain decode step) and the draft cost (drafting per step over a
plain decode step); speedup <= L / (verify + draft). `--heldout N` takes the TG prompts from the
held-out topics of the MTP draft's training prompts (run i uses prompt i mod N).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from engine import Engine, EngineConfig, SamplingParams, SpecConfig, Tokenizer
from engine.files.weights import open_model
from engine.settings import DTYPES, SPEC_TYPES
from train.prompts import chat_prompts

TEXT = Path("/usr/share/common-licenses/GPL-3")
CHAT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


@dataclass
class Result:
    system: str  # "tandem f32", "tandem f32 + draft-mtp", "transformers f32", ...
    pp: list[float] = field(default_factory=list)  # tokens/s, one per run
    tg: list[float] = field(default_factory=list)
    step_ms: list[float] = field(default_factory=list)  # tandem: mean decode step, per run
    draft_ms: list[float] = field(default_factory=list)  # of which drafting
    accept_length: list[float] = field(default_factory=list)  # tokens per decode step

    @property
    def pp_median(self) -> float:
        return statistics.median(self.pp)

    @property
    def tg_median(self) -> float:
        return statistics.median(self.tg)


def prompt_tokens(tokenizer, n: int) -> list[int]:
    """The first n tokens of plain English; repeated if the text is short."""
    text = TEXT.read_text() if TEXT.exists() else " ".join(["The quick brown fox jumps over the lazy dog."] * 400)
    ids = tokenizer.encode(text)
    while len(ids) < n:
        ids += ids
    return ids[:n]


class TandemSystem:
    def __init__(self, model: str, dtype: str, ctx: int, spec=None):
        self.name = f"tandem {dtype}" + (f" + {spec.type}" if spec else "")
        self.engine = Engine.load(EngineConfig(model=model, dtype=dtype, ctx_size=ctx, parallel=1, spec=spec))
        self.draft_s = 0.0
        self.last = (0.0, 0.0, 0.0)  # the last TG run's (step ms, draft ms per step, tokens per step)
        if self.engine.drafter is not None:
            draft = self.engine.drafter.draft

            def timed(*args):
                t0 = time.perf_counter()
                drafts = draft(*args)
                self.draft_s += time.perf_counter() - t0
                return drafts
            self.engine.drafter.draft = timed

    def pp(self, ids: list[int]) -> float:
        out = list(self.engine.generate(ids, SamplingParams(temperature=0, max_tokens=1), cache_prompt=False))
        t = out[-1].request.timings()
        return 1000 * t.prompt_n / t.prompt_ms

    def tg(self, ids: list[int], n: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        stamps, steps, drafted = [], [], []
        for out in self.engine.generate(ids, params, cache_prompt=False):
            stamps += [time.perf_counter()] * len(out.token_ids)
            steps.append(self.engine.stats.steps)
            drafted.append(self.draft_s)
        # From the first token (out of the prefill step) to the last: decode steps only.
        elapsed, decode_steps = stamps[-1] - stamps[0], steps[-1] - steps[0]
        self.last = (1000 * elapsed / decode_steps, 1000 * (drafted[-1] - drafted[0]) / decode_steps,
                     (len(stamps) - 1) / decode_steps)
        return tokens_per_second(stamps)


def tokens_per_second(stamps: list[float]) -> float:
    """TG from each generated token's arrival time: the first comes out of the prefill, so it starts the clock."""
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def load_reference(model: str):
    """transformers' own load of a model (an HF directory or a GGUF file) in fp32."""
    from transformers import AutoModelForCausalLM
    path = open_model(model).path
    if path.suffix == ".gguf":
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


class TransformersSystem:
    """transformers' own load of the same file, in fp32: the reference implementation. `hf` shares an
    already loaded model; `generate_kwargs` selects a decoding variant (e.g. prompt lookup)."""

    NAME = "transformers f32"

    def __init__(self, model: str, name: str = NAME, hf=None, **generate_kwargs):
        self.name, self.generate_kwargs = name, generate_kwargs
        self.model = hf if hf is not None else load_reference(model)

    @torch.inference_mode()
    def pp(self, ids: list[int]) -> float:
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        self.model(x, use_cache=True)
        return len(ids) / (time.perf_counter() - t0)

    @torch.inference_mode()
    def tg(self, ids: list[int], n: int) -> float:
        stamps = []

        class Stamps:  # transformers' streamer protocol: put() with the prompt, then the new tokens
            def put(self, value):
                stamps.extend([time.perf_counter()] * value.numel())

            def end(self):
                pass

        self.model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                            streamer=Stamps(), pad_token_id=self.model.config.eos_token_id, **self.generate_kwargs)
        return tokens_per_second(stamps[len(ids):])


def tg_prompts(tokenizer, heldout: int | None, message: str = CHAT) -> list[list[int]]:
    """The TG prompts: `heldout` held-out MTP training prompts, or one chat message (its text alone
    for a model without a chat template, as a random-weight model made to measure speed has none)."""
    if heldout:
        return chat_prompts(tokenizer, 0, heldout, seed=0)[1]
    if not tokenizer.chat_template:
        return [tokenizer.encode(message)]
    return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": message}]))]


def add_workload_flags(p: argparse.ArgumentParser, heldout: int | None = None) -> None:
    """The flags of the workload every speed comparison here shares (bench.formats, bench.compare)."""
    p.add_argument("-m", "--model", default="default")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--pp", type=int, default=512, help="prompt tokens for PP")
    p.add_argument("--tg", type=int, default=128, help="generated tokens for TG")
    p.add_argument("-t", "--threads", type=int, help="torch threads (default: torch's choice)")
    p.add_argument("--heldout", type=int, default=heldout,
                   help="TG prompts: this many held-out MTP training prompts (0: one chat message)")
    p.add_argument("--message", default=CHAT, help="the TG prompt's user message (without --heldout); "
                   "@FILE reads it from FILE")


def workload(args: argparse.Namespace) -> tuple[list[int], list[list[int]], int]:
    """(the PP prompt, the TG prompts, the context a slot needs for them) that add_workload_flags'
    flags ask for."""
    tokenizer = Tokenizer.load(open_model(args.model))
    message = Path(args.message[1:]).read_text() if args.message.startswith("@") else args.message
    pp_ids, prompts = prompt_tokens(tokenizer, args.pp), tg_prompts(tokenizer, args.heldout, message)
    return pp_ids, prompts, max(len(pp_ids), *(len(p) + args.tg for p in prompts)) + 1


def run(systems, pp_ids: list[int], prompts: list[list[int]], tg_n: int, runs: int, log=print) -> list[Result]:
    results = [Result(s.name) for s in systems]
    for s in systems:  # warm-up: allocator, caches, the kernels' first calls
        s.pp(pp_ids[:64])
        s.tg(prompts[0], min(8, tg_n))
    for i in range(runs):
        for s, r in zip(systems, results):
            r.pp.append(s.pp(pp_ids))
            r.tg.append(s.tg(prompts[i % len(prompts)], tg_n))
            line = f"run {i + 1}/{runs} {s.name:32s} PP {r.pp[-1]:7.1f}  TG {r.tg[-1]:6.1f} tok/s"
            if isinstance(s, TandemSystem):
                step, draft, length = s.last
                r.step_ms.append(step), r.draft_ms.append(draft), r.accept_length.append(length)
                line += f"  step {step:5.1f} ms (draft {draft:4.1f})  {length:4.2f} tokens/step"
            log(line)
    return results


def table(results: list[Result], references: list[str]) -> str:
    """Medians, and each one's ratio to every reference system that ran ('-' where one did not)."""
    refs = {r.system: r for r in results if r.system in references}
    labels = ["/" + k.split()[0] for k in references]  # "/transformers", "/llama.cpp"

    def ratios(r: Result, attr: str) -> str:
        return "".join(f" {getattr(r, attr) / getattr(refs[k], attr):{len(h) - 1}.2f}x" if k in refs
                       else f" {'-':>{len(h)}s}" for k, h in zip(references, labels))
    heads = "".join(f" {h}" for h in labels)
    lines = [f"{'system':32s} {'PP tok/s':>9s}{heads} {'TG tok/s':>9s}{heads}"]
    for r in results:
        lines.append(f"{r.system:32s} {r.pp_median:9.1f}{ratios(r, 'pp_median')} {r.tg_median:9.1f}"
                     f"{ratios(r, 'tg_median')}")
    return "\n".join(lines)


def speculation_table(results: list[Result]) -> str:
    """Each drafted system against its plain twin: TG ratio and what bounds it."""
    plain = {r.system: r for r in results}
    lines = [f"{'system':32s} {'TG ratio':>8s} {'L':>5s} {'verify':>7s} {'draft':>6s} {'L/(v+d)':>8s}"]
    for r in results:
        base = plain.get(r.system.split(" + ")[0])
        if " + " not in r.system or base is None:
            continue
        plain_step = statistics.median(base.step_ms)
        length = statistics.median(r.accept_length)
        draft = statistics.median(r.draft_ms) / plain_step
        verify = (statistics.median(r.step_ms) - statistics.median(r.draft_ms)) / plain_step
        lines.append(f"{r.system:32s} {r.tg_median / base.tg_median:7.2f}x {length:5.2f} {verify:7.2f} "
                     f"{draft:6.2f} {length / (verify + draft):7.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.formats", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_workload_flags(p)
    p.add_argument("--dtypes", nargs="+", choices=DTYPES, default=["f32", "bf16", "int8", "auto"],
                   help="weight formats (auto: a GGUF file's own q4_0 / q4_1 / q8_0 blocks)")
    p.add_argument("--no-transformers", action="store_true", help="skip the reference")
    p.add_argument("--spec-type", choices=SPEC_TYPES, help="also run each dtype with this drafter")
    p.add_argument("-md", "--spec-draft-model", help="the draft's file (draft-mtp, draft-simple)")
    p.add_argument("--spec-draft-n-max", type=int, default=3)
    p.add_argument("--spec-draft-p-min", type=float, default=0.5)
    p.add_argument("--json", type=Path, help="also write the per-run figures here")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    spec = None
    if args.spec_type:
        spec = SpecConfig(type=SPEC_TYPES[args.spec_type], draft_model=args.spec_draft_model, n_max=args.spec_draft_n_max,
                          p_min=args.spec_draft_p_min)
    pp_ids, prompts, ctx = workload(args)
    systems = [TandemSystem(args.model, d, ctx, s) for d in args.dtypes for s in ([None, spec] if spec else [None])]
    if not args.no_transformers:
        systems.append(TransformersSystem(args.model))
    print(f"model {args.model}, PP {args.pp} tokens, TG {args.tg} tokens at batch 1, "
          f"{torch.get_num_threads()} threads, {args.runs} runs", flush=True)
    results = run(systems, pp_ids, prompts, args.tg, args.runs, log=lambda line: print(line, flush=True))
    print("\nmedians:\n" + table(results, [] if args.no_transformers else [TransformersSystem.NAME]))
    if spec:
        print("\nspeculation (medians; verify and draft costs in plain decode steps):\n" + speculation_table(results))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
