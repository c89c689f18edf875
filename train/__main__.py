"""`python -m train`: train an MTP draft for a target by self-distillation (see docs/architecture.md).

    python -m train --out engine/drafts/smollm2-135m-mtp.safetensors [--minutes 15] ...

1. Data: the target's own greedy answers to chat prompts (configs/drafts/mtp-prompts*.json: every
   task template x every topic, whole topics of the first file held out) and plain English from
   /usr/share/common-licenses, all run through the engine with batched decode, while a hook keeps the
   target's hidden state after its final norm at every position. `--dtype int8 --parallel 64`
   generates ~2x faster than f32 in 16 slots, `--dtype bf16 --parallel 128` ~1.7x faster again (its
   hidden states are bf16-rounded); training always uses the file's f32 embedding.
   `--data` caches it; `--more-data` adds caches made with `--skip-prompts ... --gen-only`.
2. Labels: at position i the draft sees (h_i, x_{i+1}) and learns the target's argmax at i+1 (its
   prediction of x_{i+2}). In an answer that is the next answer token; in plain text the lm_head's argmax.
3. Model: one MTP layer whose block starts as the target's last decoder layer, eh_proj from scratch,
   and a frozen head over K ids (rows of the target's lm_head). With `--depth2 W` depth 2 (the block
   output and the drafted token) is trained too, teacher-forced, since a one-layer file reuses its
   layer for the deeper steps (`--depth2-after F`: only after the first share F of the time, once
   depth 1 has learnt something to build on); `--init` goes on training a saved draft.
4. Held-out evaluation of the chain the server drafts (n_max 3, greedy), then save (bf16) and check
   that the file loads back into MTPDraft with the same logits. configs/drafts/smollm2-135m-mtp.md
   records how the committed draft was made.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from engine import Engine, EngineConfig
from engine.model import mtp
from engine.model.layer_spec import DENSE
from train.data import load_data
from train.draft import draft_tensors, file_tensors, residual_rms, run_row, subset_ids
from train.evaluate import evaluate
from train.loop import train_draft
from train.objective import PAD
from train.prompts import PROMPTS


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m train", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the draft file (.safetensors); a .json run record goes beside it")
    ap.add_argument("--model", default="default")
    ap.add_argument("--target-name", default="SmolLM2-135M-Instruct Q4_1", help="recorded in the file's metadata")
    ap.add_argument("--prompt-file", nargs="+", default=[str(PROMPTS)],
                    help="topics x templates (JSON, as mtp-prompts.json); the first file's held-out topics evaluate")
    ap.add_argument("--prompts", type=int, default=100_000, help="most training chat prompts (default: all)")
    ap.add_argument("--heldout", type=int, default=64, help="held-out chat prompts for the evaluation")
    ap.add_argument("--max-tokens", type=int, default=192, help="longest answer")
    ap.add_argument("--text-tokens", type=int, default=32_768, help="tokens of licence text")
    ap.add_argument("--gen-minutes", type=float, default=32, help="time limit of data generation")
    ap.add_argument("--data", help="cache of the generated data: read if it exists, else written")
    ap.add_argument("--more-data", nargs="*", default=[], help="caches whose training sequences are added")
    ap.add_argument("--skip-prompts", type=int, default=0, help="start at this training prompt (to add data)")
    ap.add_argument("--gen-only", action="store_true", help="stop once the data is written")
    ap.add_argument("--dtype", default="f32", choices=("f32", "bf16", "int8"),
                    help="the target's weight format while generating: int8 in 64 slots is ~2x f32 in 16, "
                         "bf16 in 128 (beyond the int8 kernel's 64 rows) ~1.7x int8 in 64")
    ap.add_argument("--parallel", type=int, default=16, help="slots generating at once")
    ap.add_argument("--minutes", type=float, default=15, help="training time")
    ap.add_argument("--subset", type=int, default=8192, help="head size K")
    ap.add_argument("--init", help="a saved draft to go on training instead of a fresh one")
    ap.add_argument("--eh-init", choices=("random", "identity"), default="identity")
    ap.add_argument("--scale-norms", action=argparse.BooleanOptionalAction, default=True,
                    help="start enorm/hnorm at the residual RMS entering the target's last layer (else 1)")
    ap.add_argument("--train-head", action=argparse.BooleanOptionalAction, default=False)
    ap.add_argument("--depth2", type=float, default=0.0, help="weight of the depth-2 loss (0: depth 1 only)")
    ap.add_argument("--depth2-after", type=float, default=0.0,
                    help="share of the training time that trains depth 1 alone before the depth-2 loss starts")
    ap.add_argument("--soft", type=float, default=0.0,
                    help="share of the soft-target term in the loss (costs 2.5x per sequence at K=8192)")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="train under bf16 autocast")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--batch", type=int, default=8, help="sequences per optimizer step")
    ap.add_argument("--threads", type=int, default=1, help="1 is far faster than 2 while other work shares the cores")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    times, t0 = {}, time.perf_counter()
    engine = Engine.load(EngineConfig(model=args.model, dtype=args.dtype, parallel=args.parallel,
                                      ctx_size=args.parallel * 512, threads=args.threads))
    times["load"] = time.perf_counter() - t0
    data = load_data(engine, args)
    if args.gen_only:
        return
    times["data"] = data.seconds
    print(f"data: {len(data.train)} train sequences ({data.train_labels} labels), {len(data.heldout)} held-out, "
          f"{data.seconds:.0f} s", flush=True)
    t0 = time.perf_counter()
    cfg, target = engine.files.config, engine.files.load_tensors()
    if args.init:  # go on training a saved draft (its subset included)
        start = mtp.load_tensors(args.init)
        print(f"draft: from {args.init}, K={len(start['head.vocab_ids'])}", flush=True)
    else:
        vocab_ids = subset_ids(data, args.subset, cfg.vocab_size)
        scale = residual_rms(engine, data.train[-1].next_ids.tolist()) if args.scale_norms else 1.0
        print(f"draft: K={len(vocab_ids)}, enorm/hnorm start at {scale:.1f}", flush=True)
        start = draft_tensors(cfg, target, vocab_ids, args.eh_init, args.seed, scale)
    max_len = max(len(s.next_ids) for s in data.train + data.heldout)
    draft = mtp.MTPDraft(cfg, start, [DENSE], "f32", 2 * (max_len + PAD))
    fingerprint = mtp.target_fingerprint(cfg, target["model.embed_tokens.weight"])
    # The file's f32 embedding, frozen and shared with the target whatever format generated the data.
    embed = torch.nn.Embedding.from_pretrained(target["model.embed_tokens.weight"])
    del target
    result = train_draft(draft, embed, data, args)
    times["train"] = time.perf_counter() - t0
    for b in file_tensors(draft).values():  # what the file holds: evaluate exactly that
        if b.is_floating_point():
            b.copy_(b.to(torch.bfloat16).float())
    t0 = time.perf_counter()
    heldout = evaluate(draft, embed, data.heldout)
    seen = evaluate(draft, embed, [s for s in data.train if s.labels[0] < 0][:32])  # training answers
    times["evaluate"] = time.perf_counter() - t0
    mtp.save(args.out, file_tensors(draft), num_layers=1, fingerprint=fingerprint, target_name=args.target_name,
             dtype=torch.bfloat16)
    loaded = mtp.MTPDraft(cfg, mtp.load_tensors(args.out), [DENSE], "f32", draft.cos.shape[0])
    s = data.heldout[0]
    with torch.no_grad():
        same = torch.equal(*(run_row(d, s.hidden, embed(s.next_ids))[1] for d in (draft, loaded)))
    assert same, "the saved draft does not reproduce the trained logits"
    record = {"args": vars(args), "times_s": {k: round(v) for k, v in times.items()}, "train": result,
              "data": {"train_sequences": len(data.train), "train_labels": data.train_labels, "prompts": data.prompts,
                       "heldout_prompts": data.heldout_prompts, "text_chunks": data.text_chunks},
              "heldout": {**asdict(heldout), "mean_length": heldout.mean_length},
              "train_sample": asdict(seen), "file_bytes": Path(args.out).stat().st_size}
    Path(args.out).with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
