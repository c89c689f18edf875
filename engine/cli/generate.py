"""`python -m engine.cli.generate`: stream one chat answer from a model and print PP and TG speed."""
from __future__ import annotations

import argparse
import sys

from engine.engine import Engine
from engine.errors import TandemError
from engine.files.tokenizer import IncrementalDecoder
from engine.sched.sampling import SamplingParams
from engine.settings import DTYPES, EngineConfig


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m engine.cli.generate", description=__doc__)
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("-m", "--model", default="default", help="HF directory, .gguf file, or 'default' (SmolLM2-135M)")
    p.add_argument("--dtype", choices=DTYPES, default="f32", help="weight format")
    p.add_argument("--system", help="system message (else the chat template's default)")
    p.add_argument("--raw", action="store_true", help="send the prompt as plain text, without the chat template")
    p.add_argument("-n", "--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("-c", "--ctx-size", type=int, default=4096)
    p.add_argument("-t", "--threads", type=int)
    p.add_argument("--chat-template", help="a Jinja chat template file replacing the model's")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                                seed=args.seed, max_tokens=args.max_tokens)
        engine = Engine.load(EngineConfig(model=args.model, dtype=args.dtype, ctx_size=args.ctx_size,
                                          threads=args.threads, chat_template=args.chat_template))
        tok = engine.tokenizer
        if args.raw:
            text = args.prompt
        else:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                       [{"role": "user", "content": args.prompt}]
            text = tok.apply_chat_template(messages)
        prompt_ids = tok.encode(text)
        engine.admission.check_prompt(len(prompt_ids), params.max_tokens)
    except TandemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    decoder = IncrementalDecoder(tok)
    out = None
    for out in engine.generate(prompt_ids, params):
        sys.stdout.write(decoder.push(out.token_ids))
        sys.stdout.flush()
    t = out.request.timings()
    print(f"\n\n[{t.cache_n + t.prompt_n} prompt tokens, PP {1000 * t.prompt_n / t.prompt_ms:.1f} tok/s | "
          f"{t.predicted_n} generated, TG {_tg(t):.1f} tok/s | finish: {out.request.finish_reason} | "
          f"{args.dtype}]", file=sys.stderr)
    return 0


def _tg(t) -> float:
    # The first token comes out of the prefill; TG counts the tokens decoded after it.
    return 1000 * (t.predicted_n - 1) / t.predicted_ms if t.predicted_ms > 0 else 0.0


if __name__ == "__main__":
    sys.exit(main())
