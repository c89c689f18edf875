"""python -m bench --url URL --model NAME [--workload standard] [--prompt-tokens N] [--gen-tokens N]
[--lanes N] [--runs N] [--out records.jsonl] [--json] [--plot tg.png]

Exit codes: 0 done (invalid records are reported, not failures), 2 the benchmark could not be set
up as asked (nothing measured was sent), 130 interrupted with Ctrl-C (the summary covers the
records so far, and --out holds every one of them).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import signal
import sys
from typing import TextIO

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from bench.plot import plot
from bench.records import Record
from bench.session import Session
from bench.summary import render, summarize
from bench.workload import WORKLOADS, FixtureError, Workload

SHAPE_FLAGS = ("prompt_tokens", "gen_tokens", "lanes", "runs", "seed", "temperature")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description="PP, TG and latency of an OpenAI-style "
                                "server under concurrent streaming /v1/completions requests")
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8080")
    p.add_argument("--model", required=True, help="model name sent with each request (as /v1/models lists it)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="standard",
                   help="named workload; the flags below override its fields")
    p.add_argument("--prompt-tokens", type=int, help="exact prompt length, as the server's /tokenize counts")
    p.add_argument("--gen-tokens", type=int, help="exact tokens generated per request (ignore_eos)")
    p.add_argument("--lanes", type=int, help="concurrent requests per round")
    p.add_argument("--runs", type=int, help="rounds")
    p.add_argument("--seed", type=int, help="seed of the prompts' text and of sampling")
    p.add_argument("--temperature", type=float, help="sampling temperature (0: greedy)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds a single read may wait")
    p.add_argument("--out", help="write one JSON record per request here (JSONL), as each completes")
    p.add_argument("--json", action="store_true", help="print the summary as JSON instead of tables")
    p.add_argument("--plot", metavar="FILE.png", help="draw TG per request and acceptance per run")
    return p


def workload_from(args: argparse.Namespace) -> Workload:
    base = WORKLOADS[args.workload]
    overrides = {k: getattr(args, k) for k in SHAPE_FLAGS if getattr(args, k) is not None}
    if all(getattr(base, k) == v for k, v in overrides.items()):
        return base
    return dataclasses.replace(base, **overrides, name="custom")


def open_records(path: str) -> TextIO:
    try:
        return open(path, "w")
    except OSError as e:
        raise FixtureError(f"--out {path}: {e.strerror}") from e


async def measure(args: argparse.Namespace, workload: Workload, console: Console) -> int:
    async with contextlib.AsyncExitStack() as stack:
        out = stack.enter_context(open_records(args.out)) if args.out else None
        session = await stack.enter_async_context(Session(args.url, args.model, workload, args.timeout))
        console.print(f"preparing {workload.runs * workload.lanes} prompts and a warm-up request ...")
        await session.prepare()
        await run_with_progress(session, out, console)
    summary = summarize(session.records, session.describe(), session.interrupted)
    if args.json:
        print(json.dumps(summary.to_json(), indent=2))
    else:
        # Piped output would otherwise wrap the table at rich's 80-column default.
        Console(width=None if sys.stdout.isatty() else 120).print(render(summary))
    if args.plot:
        plot(session.records, summary, args.plot)
        console.print(f"plot written to {args.plot}")
    return 130 if session.interrupted else 0


async def run_with_progress(session: Session, out: TextIO | None, console: Console) -> None:
    """The measured rounds under a progress bar; the first Ctrl-C ends them cleanly."""
    total = session.workload.runs * session.workload.lanes
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console) as progress:
        bar = progress.add_task("requests", total=total)

        def on_record(record: Record) -> None:
            if out is not None:  # flushed per record: an interrupted session loses nothing
                out.write(record.to_json() + "\n")
                out.flush()
            invalid = sum(not r.valid for r in session.records)
            progress.update(bar, advance=1, description=f"requests ({invalid} invalid)")

        loop = asyncio.get_running_loop()

        def on_sigint() -> None:
            console.print("interrupted: finishing records of the requests in flight (Ctrl-C again to abort)")
            loop.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C raises KeyboardInterrupt
            session.interrupt()

        loop.add_signal_handler(signal.SIGINT, on_sigint)
        try:
            await session.run(on_record)
        finally:
            loop.remove_signal_handler(signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    console = Console(stderr=True)  # progress and notes; stdout carries only the summary
    try:
        return asyncio.run(measure(args, workload_from(args), console))
    except FixtureError as e:
        console.print(f"bench: {e}", style="red", markup=False, highlight=False)
        return 2
    except KeyboardInterrupt:
        console.print("aborted (records completed so far are in --out, if given)")
        return 130


if __name__ == "__main__":
    sys.exit(main())
