"""The attention a prompt's last token pays to its tokens, per chosen layer, from a shell:

    python -m engine.cli.probe --prompt TEXT --layers 15,29 [--kind head_mean --group 4] [--out F.npy] [--plot F.png]
"""
from __future__ import annotations

import argparse

import numpy as np

from engine.engine import Engine
from engine.errors import ConfigError
from engine.model.probe import KINDS, ProbeSpec
from engine.sched.sampling import SamplingParams
from engine.settings import EngineConfig


def main() -> None:
    parser = argparse.ArgumentParser(description="The attention a prompt's last token pays to its tokens, per chosen layer.")
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--layers", required=True, help="comma-separated trunk layer indices, e.g. 15,29 or -1")
    parser.add_argument("--kind", default="head_mean", choices=KINDS)
    parser.add_argument("--group", type=int, help='key positions per group (kind "head_mean"; default 1)')
    parser.add_argument("-m", "--model", default="default")
    parser.add_argument("--out", help="save the layers' values (head_mean) or q (qk) stacked, as .npy")
    parser.add_argument("--plot", help="save a heat strip over the prompt's tokens, one row per layer, as .png")
    args = parser.parse_args()
    if args.plot and args.kind == "qk":
        parser.error('--plot draws attention: it needs --kind head_mean')
    try:
        spec = ProbeSpec(tuple(int(i) for i in args.layers.split(",")), args.kind, group=args.group)
    except (ConfigError, ValueError) as e:
        parser.error(str(e))
    engine = Engine.load(EngineConfig(model=args.model, parallel=1))
    ids = engine.tokenizer.encode(args.prompt)
    try:
        engine.admission.check_probe(spec, len(ids))
    except ConfigError as e:
        parser.error(str(e))
    for out in engine.generate(ids, SamplingParams(temperature=0, max_tokens=1), probe=spec):
        result = out.request.probe_result
    key = "values" if spec.kind == "head_mean" else "q"
    stacked = np.stack([r.tensors[key].numpy() for r in result])
    for r in result:
        print(f"layer {r.layer}: {key} {list(r.tensors[key].shape)} over key positions "
              f"{r.key_positions.start}..{r.key_positions.stop - 1}{' (sparse)' if r.sparse else ''}")
    if args.out:
        np.save(args.out, stacked)
    if args.plot:
        plot_strip(stacked, [engine.tokenizer.decode([t]) for t in ids], [r.layer for r in result], spec.group,
                   args.plot)


def plot_strip(values, tokens: list[str], layers: list[int], group: int, path: str) -> None:
    """values [layers, groups]: one row per layer, a column per group of `group` tokens, labelled by
    the group's first token."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6.0, 0.3 * values.shape[1]), 1.0 + 0.5 * len(layers)))
    image = ax.imshow(values, aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(layers)), [f"layer {i}" for i in layers])
    ax.set_xticks(range(values.shape[1]), [repr(t)[1:-1] for t in tokens[::group]], rotation=90, fontsize=7)
    fig.colorbar(image, ax=ax, label="attention")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
