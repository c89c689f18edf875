"""Constrained-decoding libraries on the default model's vocabulary: what a schema costs to compile,
what a token's mask costs, and the memory each holds.

    python -m bench.grammar_libs [--libs llguidance,xgrammar] [--repeat 3]

llguidance is tandem's (engine/grammar.py); xgrammar is measured beside it when installed
(`pip install xgrammar`: it brings triton and apache-tvm-ffi). Each library walks the same valid
answer to the same schema token by token, computing the mask before each token as a decode step
does, and the medians of --repeat walks are printed with the resident memory each added (tokenizer, compiled grammar, matcher).
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"type": "string", "enum": ["red", "green", "blue"]},
                 "minItems": 1, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                    "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]},
    },
    "required": ["name", "age", "tags", "address"],
}
ANSWER = {"name": "Ada Lovelace", "age": 36, "tags": ["red", "blue"], "address": {"city": "London", "zip": "12345"}}


def _rss_mib() -> float:
    """Resident memory now (not the peak, which the first library measured would keep)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def measure_llguidance(hf, vocab: int, tokens: list[int]) -> dict:
    import llguidance
    import llguidance.hf
    import llguidance.torch
    before = _rss_mib()
    start = time.perf_counter()
    tokenizer = llguidance.hf.from_tokenizer(hf, n_vocab=vocab)
    wrap = time.perf_counter() - start
    start = time.perf_counter()
    grammar = llguidance.LLMatcher.grammar_from_json_schema(SCHEMA)
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    compile_s = time.perf_counter() - start
    bitmask = llguidance.torch.allocate_token_bitmask(1, vocab)
    start = time.perf_counter()
    for t in tokens:
        llguidance.torch.fill_next_token_bitmask(matcher, bitmask)
        assert matcher.consume_token(t), "the answer left the grammar"
    mask_s = (time.perf_counter() - start) / len(tokens)
    return {"wrap_s": wrap, "compile_s": compile_s, "mask_ms": 1000 * mask_s, "rss_mib": _rss_mib() - before}


def measure_xgrammar(hf, vocab: int, tokens: list[int]) -> dict:
    import xgrammar
    before = _rss_mib()
    start = time.perf_counter()
    info = xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab)
    compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
    wrap = time.perf_counter() - start
    start = time.perf_counter()
    matcher = xgrammar.GrammarMatcher(compiler.compile_json_schema(json.dumps(SCHEMA)))
    compile_s = time.perf_counter() - start
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    start = time.perf_counter()
    for t in tokens:
        matcher.fill_next_token_bitmask(bitmask)
        assert matcher.accept_token(t), "the answer left the grammar"
    mask_s = (time.perf_counter() - start) / len(tokens)
    return {"wrap_s": wrap, "compile_s": compile_s, "mask_ms": 1000 * mask_s, "rss_mib": _rss_mib() - before}


MEASURE = {"llguidance": measure_llguidance, "xgrammar": measure_xgrammar}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--libs", default="llguidance,xgrammar")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("-m", "--model", default="default")
    args = parser.parse_args(argv)
    from engine.files.tokenizer import Tokenizer
    from engine.files.weights import open_model
    files = open_model(args.model)
    tok = Tokenizer.load(files)
    tokens = tok.encode(json.dumps(ANSWER))
    print(f"vocabulary {files.config.vocab_size}, answer {len(tokens)} tokens")
    print("| library | tokenizer wrap s | schema compile ms | mask ms/token | RSS added MiB |")
    print("|---|---:|---:|---:|---:|")
    for name in args.libs.split(","):
        try:
            runs = [MEASURE[name](tok.hf, files.config.vocab_size, tokens) for _ in range(args.repeat)]
        except (ImportError, KeyError):
            print(f"| {name} | not installed | | | |")
            continue
        med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print(f"| {name} | {med['wrap_s']:.2f} | {1000 * med['compile_s']:.1f} | {med['mask_ms']:.3f} | "
              f"{runs[0]['rss_mib']:.0f} |")


if __name__ == "__main__":
    main()
