"""`python -m engine.validate PATH`: a model's summary from its file headers, or one clear error
(exit code 2). No tensor data is read."""
from __future__ import annotations

import argparse
import sys

from engine.config import describe_rope, kv_bytes_per_token
from engine.errors import TandemError
from engine.kv_cache import KV_DTYPES
from engine.quant import BYTES_PER_WEIGHT
from engine.weights import open_model


# q8_0 stores 32 int8 values and one f16 scale per block: 34 bytes per 32 values.
KV_BYTES_PER_VALUE = {d: (34 / 32 if d == "q8_0" else t.itemsize) for d, t in KV_DTYPES.items()}


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def summary(path: str) -> str:
    files = open_model(path)
    c = files.config
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
        f"parameters:   {params / 1e6:.1f} M",
        "weights:      " + ", ".join(f"{d} {_size(params * b)}" for d, b in BYTES_PER_WEIGHT.items()),
    ]
    for kind, value in kv_bytes_per_token(c, 1).items():
        per_dtype = ", ".join(f"{d} {_size(value * KV_BYTES_PER_VALUE[d])}" for d in KV_DTYPES)
        layers = sum(1 for r in c.layer_ratios if (r == 0) == (kind == "dense"))
        lines.append(f"KV per token per {kind} layer ({layers} layers): {per_dtype}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m engine.validate", description=__doc__)
    p.add_argument("path", help="HF model directory, .gguf file, or 'default'")
    args = p.parse_args(argv)
    try:
        print(summary(args.path))
    except TandemError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
