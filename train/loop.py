"""The training loop: AdamW over the draft's layer (and optionally its head) for a time budget, with
warm-up and cosine decay, depth 2 switched on after a share of the time."""
from __future__ import annotations

import math
import random
import time

import torch

from train.data import Data
from train.objective import Objective, sequence_loss


def train_draft(draft, embed, data: Data, args) -> dict:
    trainable = ["layers.0."] + (["head."] if args.train_head else [])
    params = [b.requires_grad_(True) for n, b in draft.named_buffers()
              if n.endswith(".weight") and any(n.startswith(p) for p in trainable)]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)
    obj = Objective.for_draft(draft, args.depth2, args.soft)
    rng, order = random.Random(args.seed), []
    t0, step, seen, log = time.perf_counter(), 0, 0, [0.0, 0, 0]
    while (frac := (time.perf_counter() - t0) / (60 * args.minutes)) < 1:
        if not order:
            order = list(range(len(data.train)))
            rng.shuffle(order)
        lr = args.lr * min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * frac))  # warm-up, cosine
        obj.depth2 = args.depth2 if frac >= args.depth2_after else 0.0
        for group in opt.param_groups:
            group["lr"] = lr
        batch, order = order[:args.batch], order[args.batch:]
        total = sum(int((data.train[i].labels >= 0).sum()) for i in batch)
        for i in batch:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.bf16):  # 1.5x faster here
                loss, n, hits = sequence_loss(draft, embed, data.train[i], obj)
            (loss / max(total, 1)).backward()
            log = [log[0] + loss.item(), log[1] + n, log[2] + hits]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step, seen = step + 1, seen + len(batch)
        if step % 25 == 0:
            print(f"  train: step {step}, epoch {seen / len(data.train):.2f}, lr {lr:.2e}, loss {log[0] / log[1]:.3f}, "
                  f"depth-1 acc {log[2] / log[1]:.3f}, {time.perf_counter() - t0:.0f} s", flush=True)
            log = [0.0, 0, 0]
    for p in params:
        p.requires_grad_(False)
    return {"steps": step, "epochs": round(seen / len(data.train), 2), "seconds": round(time.perf_counter() - t0)}
