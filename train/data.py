"""The training data: the target's hidden states and labels over its own answers and plain text,
generated through the engine, and its cache on disk."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from engine import Engine, SamplingParams
from train.prompts import chat_prompts, licence_chunks


@dataclass
class Sequence:
    """One text as the target saw it: hidden[i] after the final norm at position i, [n, H] f32;
    next_ids[i] = x_{i+1}; labels[i] = the target's argmax at i+1, or -1 where no loss is taken."""
    hidden: torch.Tensor
    next_ids: torch.Tensor
    labels: torch.Tensor


@dataclass
class Data:
    train: list[Sequence]
    heldout: list[Sequence]
    prompts: int  # chat prompts answered for training (held-out ones not counted)
    heldout_prompts: int
    text_chunks: int
    seconds: float

    def save(self, path: str) -> None:
        torch.save(asdict(self), path)  # plain dicts and tensors: readable without this module's classes

    @classmethod
    def load(cls, path: str) -> "Data":
        d = torch.load(path)
        return cls(**{**d, "train": [Sequence(**s) for s in d["train"]], "heldout": [Sequence(**s) for s in d["heldout"]]})

    @property
    def train_labels(self) -> int:
        return sum(int((s.labels >= 0).sum()) for s in self.train)


def generate(engine: Engine, prompts: list[list[int]], max_tokens: list[int], minutes: float) -> list[Sequence | None]:
    """Runs every prompt through the engine (greedy, batched) until done or out of time; returns one
    Sequence per prompt (None if time ran out before it started), in prompt order. Answer positions
    are labeled with the next-next answer token; prompt positions are left to the caller (-1)."""
    captured: dict[str, list[tuple[int, torch.Tensor]]] = {}

    def keep_hidden(module, args, hidden):  # runs on every forward: rows map to slots' requests
        offset = 0
        for row in args[0].rows:
            req = engine.scheduler.slots[row.slot].request
            captured.setdefault(req.id, []).append((row.start, hidden[offset:offset + len(row.tokens)].clone()))
            offset += len(row.tokens)

    hook = engine.model.register_forward_hook(keep_hidden)
    reqs = [engine.submit(p, SamplingParams(temperature=0, max_tokens=m), lambda out: None, cache_prompt=False)
            for p, m in zip(prompts, max_tokens)]
    t0, last, deadline = time.perf_counter(), 0.0, time.perf_counter() + 60 * minutes
    while engine.busy and time.perf_counter() < deadline:
        engine.step()
        if time.perf_counter() - last > 30:
            last = time.perf_counter()
            done = sum(r.finish_reason is not None for r in reqs)
            made = sum(len(r.output_ids) for r in reqs)
            print(f"  generate: {done}/{len(reqs)} done, {made} tokens, {made / (last - t0):.0f} tok/s", flush=True)
    hook.remove()
    out = []
    for req in reqs:
        if req.id not in captured:
            out.append(None)
            continue
        chunks = sorted(captured[req.id], key=lambda c: c[0])
        hidden = torch.cat([c[1] for c in chunks]).float()  # positions 0 .. num_computed-1
        ids = req.prompt_ids + req.output_ids + ([engine.tokenizer.eos_token_id] if req.finish_reason == "stop" else [])
        n = min(len(hidden), len(ids) - 1)
        labels = torch.full((n,), -1, dtype=torch.long)
        p = len(req.prompt_ids)  # h_{p-1} yields the first answer token x_p; label at i is x_{i+2}
        answer = torch.tensor(ids[p + 1:n + 1], dtype=torch.long)
        labels[p - 1:p - 1 + len(answer)] = answer
        out.append(Sequence(hidden[:n], torch.tensor(ids[1:n + 1]), labels))
    return out


def collect(engine: Engine, args) -> Data:
    t0 = time.perf_counter()
    train_p, heldout_p = chat_prompts(engine.tokenizer, args.skip_prompts + args.prompts, args.heldout, args.seed,
                                     args.prompt_file)
    train_p = train_p[args.skip_prompts:]
    texts = licence_chunks(engine.tokenizer, args.text_tokens)
    prompts = heldout_p + texts + train_p  # held-out answers first: the evaluation needs them
    limits = [args.max_tokens] * len(heldout_p) + [1] * len(texts) + [args.max_tokens] * len(train_p)
    print(f"data: {len(train_p)} train + {len(heldout_p)} held-out prompts, {len(texts)} text chunks", flush=True)
    seqs = generate(engine, prompts, limits, args.gen_minutes)
    heldout, rest = seqs[:len(heldout_p)], seqs[len(heldout_p):]
    for s in filter(None, rest[:len(texts)]):  # plain text: the lm_head's argmax at every position but the first
        with torch.inference_mode():
            top = engine.model.logits(s.hidden[1:].to(engine.model.compute_dtype)).argmax(-1)
        s.labels = torch.cat([top, torch.tensor([-1])]).clone()
    kept = [s is not None and bool((s.labels >= 0).any()) for s in rest]
    keep, texts = [s for s, k in zip(rest, kept) if k], sum(kept[:len(texts)])
    return Data(keep, [s for s in heldout if s is not None], len(keep) - texts, len(heldout), texts, time.perf_counter() - t0)


def load_data(engine: Engine, args) -> Data:
    if args.data and Path(args.data).is_file():
        data = Data.load(args.data)
        print(f"data: read {args.data}", flush=True)
    else:
        data = collect(engine, args)
        if args.data:
            data.save(args.data)
    for path in args.more_data:
        more = Data.load(path)
        data.train += more.train
        data.prompts, data.text_chunks = data.prompts + more.prompts, data.text_chunks + more.text_chunks
        data.seconds += more.seconds
    return data
