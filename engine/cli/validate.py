"""`python -m engine.cli.validate PATH [--compress-ratios R] [--qsa-budget N] [-c CTX -np N]`: a model's
summary from its file headers, or one clear error (exit code 2). No tensor data is read. With a
context size it adds the KV cache's and the pooled keys' bytes per layer kind."""
from __future__ import annotations

import argparse
import sys

from engine.errors import TandemError
from engine.files.model_config import (FULL_ATTENTION, LINEAR_ATTENTION, cache_bytes_per_position, describe_rope,
                                       recurrent_state_bytes, with_compression)
from engine.model.recurrent_cache import SNAPSHOTS
from engine.files.weights import ModelFiles, open_model
from engine.model.kv_cache import KV_BYTES_PER_VALUE, KV_DTYPES
from engine.files.nearest_format import stored_formats
from engine.ops.quant import BYTES_PER_WEIGHT, describe_formats
from engine.settings import DTYPES, CompressRatios


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _hybrid_lines(files: ModelFiles, c) -> list[str]:
    """A Qwen3.5 model's layer kinds, Gated DeltaNet geometry, state per slot and MTP layers."""
    lines = []
    if c.linear is not None:
        lin, kinds = c.linear, c.kinds
        attention = [i for i, kind in enumerate(kinds) if kind == FULL_ATTENTION]
        state = recurrent_state_bytes(c)
        lines += [
            f"layer kinds:  {c.recurrent_layers} {LINEAR_ATTENTION} (Gated DeltaNet), {len(attention)} {FULL_ATTENTION} "
            f"(layers {','.join(map(str, attention))})",
            f"linear attn:  {lin.num_k_heads} key heads x {lin.k_head_dim}, {lin.num_v_heads} value heads x "
            f"{lin.v_head_dim}, conv kernel {lin.conv_kernel}" + (" (value heads tiled, as llama.cpp's GGUF stores "
                                                                  "them)" if lin.tiled_v_heads else ""),
            f"state:        {_size(state)} per slot and position kept (recurrent state and conv tail, f32); a slot "
            f"keeps 1 + --spec-draft-n-max positions with speculation (1 without) and {SNAPSHOTS} snapshots",
        ]
    if c.attn_output_gate or c.rotary_dim < c.head_dim:
        lines.append(f"attention:    {'gated output, ' if c.attn_output_gate else ''}RoPE on {c.rotary_dim} of "
                     f"{c.head_dim} dims")
    lines += _qwen4_exp_lines(c)
    if files.has_mtp:
        layer = "blk.N.nextn.*" if files.format == "gguf" else "mtp.*"
        lines.append(f"MTP:          {c.num_nextn_predict_layers} layer(s) of the model's own ({layer}): "
                     f"--spec-type draft-mtp drafts with them" + ("" if files.has_trunk else
                                                                   "; this file holds no trunk: give it as -md"))
    return lines


def _qwen4_exp_lines(c) -> list[str]:
    """Qwen4-Exp's experts, residual streams, QSA indexer and n-gram embeddings."""
    lines = []
    if c.experts is not None:
        e = c.experts
        lines.append(f"experts:      {e.top_k} of {e.count} per token (width {e.intermediate}) and a shared expert "
                     f"(width {e.shared_intermediate})")
    if c.hc_count:
        lines.append(f"residual:     {c.hc_count} streams, hyper-connections of rank {c.hc_lowrank}")
    if c.indexer is not None:
        x = c.indexer
        lines.append(f"QSA indexer:  {x.heads} query heads x {x.head_dim}, blocks of {x.ratio}, budget {x.budget} "
                     f"positions ({x.budget // x.ratio} blocks) on every attention layer")
    if c.ngram is not None:
        g = c.ngram
        lines.append(f"n-grams:      layers {','.join(map(str, g.layers))}: 2..{g.ngram}-grams, {g.heads} hashed "
                     f"heads, {g.embed_dim} wide, conv kernel {g.conv_kernel} dilated {g.ngram}")
    return lines


def summary(path: str, ratios: CompressRatios | None = None, budget: int | None = None,
            ctx_size: int | None = None, parallel: int = 1) -> str:
    files = open_model(path, trunk=False)
    c, _ = with_compression(files.config, ratios, budget)
    params = c.num_parameters()
    lines = [
        f"model:        {files.path} ({files.format})",
        f"architecture: {c.family}",
        f"layers:       {c.num_layers}" + (f" (+{c.num_nextn_predict_layers} MTP)" if c.num_nextn_predict_layers else ""),
        f"hidden:       {c.hidden_size} (intermediate {c.intermediate_size})",
        f"heads:        {c.num_heads} (kv heads {c.num_kv_heads}, head_dim {c.head_dim})",
        f"vocab:        {c.vocab_size}" + (" (tied embeddings)" if c.tie_word_embeddings else ""),
        f"rope:         {describe_rope(c.rope)}",
        f"context:      {c.max_position_embeddings}",
        *_hybrid_lines(files, c),
        f"parameters:   {params / 1e6:.1f} M",
        "weights:      " + ", ".join(f"{d} {_size(params * BYTES_PER_WEIGHT[d])}" for d in DTYPES if d != "auto"),
        "weights as stored (--dtype auto): " + describe_formats(stored_formats(files)),
    ]
    if any(c.layer_ratios):
        lines.append(f"compression:  ratios {','.join(map(str, c.layer_ratios))}, qsa_budget {c.qsa_budget}")
    for kind, (layers, kv, pool) in cache_bytes_per_position(c, 1).items():
        per_dtype = ", ".join(f"{d} {_size(kv * KV_BYTES_PER_VALUE[d] + pool)}" for d in KV_DTYPES)
        lines.append(f"KV per token per {kind} layer ({layers} layers): {per_dtype}")
    if ctx_size:
        ctx_size = ctx_size // parallel * parallel  # each slot's share, as the engine splits it
        total_kv = total_pool = 0.0
        for kind, (layers, kv, pool) in cache_bytes_per_position(c, KV_BYTES_PER_VALUE["f32"]).items():
            kv_bytes, pool_bytes = layers * kv * ctx_size, layers * pool * ctx_size
            total_kv, total_pool = total_kv + kv_bytes, total_pool + pool_bytes
            pooled = f", kpool {_size(pool_bytes)}" if pool_bytes else ""
            lines.append(f"KV cache at {ctx_size} positions, f32, {kind} ({layers} layers): {_size(kv_bytes)}{pooled}")
        lines.append(f"KV cache at {ctx_size} positions, f32, total: {_size(total_kv)}, kpool {_size(total_pool)}")
    return "\n".join(lines)


def _ratios(value: str) -> CompressRatios:
    try:
        return CompressRatios.parse(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.cli.validate", description=__doc__.split("\n\n")[0])
    p.add_argument("path", help="HF model directory, .gguf file, or 'default'")
    p.add_argument("--compress-ratios", type=_ratios, help="as the server's flag: a list, everyN:R, all:R or none")
    p.add_argument("--qsa-budget", type=int, help="as the server's flag")
    p.add_argument("-c", "--ctx-size", type=int, help="total context (all slots): adds the cache's bytes")
    p.add_argument("-np", "--parallel", type=int, default=1, help="slots (the total context is split among them)")
    args = p.parse_args(argv)
    try:
        print(summary(args.path, args.compress_ratios, args.qsa_budget, args.ctx_size, args.parallel))
    except TandemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
