"""Train an MTP draft for a target by self-distillation (DESIGN.md, "MTP draft").

    python -m engine.train_mtp --out configs/drafts/smollm2-135m-mtp.safetensors [--minutes 15] ...

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
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engine import mtp
from engine.batch import ForwardBatch, Row, causal_mask
from engine.engine import Engine, EngineConfig
from engine.kv_cache import KVCache
from engine.model import split_fused
from engine.sampling import SamplingParams

PROMPTS = Path(__file__).resolve().parent.parent / "configs" / "drafts" / "mtp-prompts.json"
# Training pads each sequence's length to a multiple of PAD: oneDNN builds a kernel for every
# matrix shape and keeps about a thousand, so with every length its own shape a step kept paying
# for kernel builds (8 sequences: 0.49-0.52 s a step unpadded, 0.31 s padded).
PAD = 64
LICENCES = ("GPL-3", "Apache-2.0", "MPL-2.0", "LGPL-2.1", "GFDL-1.3", "Artistic", "CC0-1.0", "BSD", "GPL-2")


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


@dataclass
class Evaluation:
    positions: int  # answer positions scored at depth 1
    coverage: float  # fraction of labels inside the head's subset
    accept1: float  # depth-1 argmax == the target's next-next token
    accept2_given1: float  # depth 2 right, given depth 1 right
    accept3_given12: float
    mean_accepted: dict  # n_max -> drafts accepted per verify step (greedy, p_min 0)

    @property
    def mean_length(self) -> dict:
        """n_max -> tokens per verify step: the accepted drafts plus the target's own token."""
        return {n: round(1 + a, 3) for n, a in self.mean_accepted.items()}


def chat_prompts(tokenizer, n_train: int, n_heldout: int, seed: int,
                 paths: list[Path] = (PROMPTS,)) -> tuple[list[list[int]], list[list[int]]]:
    """Training prompts: each file's in turn, each file shuffled on its own (so a file's order does
    not depend on the files before it). Held-out prompts: the first file's only, one evaluation set."""
    train, heldout = [], []
    for i, path in enumerate(paths):
        spec = json.loads(Path(path).read_text())
        file_train, file_heldout, every = [], [], spec["held_out_every"]  # 0: nothing held out
        for t, topic in enumerate(spec["topics"]):
            for template in spec["templates"]:
                text = tokenizer.apply_chat_template([{"role": "user", "content": template.format(topic=topic)}])
                (file_heldout if every and t % every == every - 1 else file_train).append(tokenizer.encode(text))
        rng = random.Random(seed)
        rng.shuffle(file_train)
        rng.shuffle(file_heldout)
        train += file_train
        if i == 0:
            heldout = file_heldout
    return train[:n_train], heldout[:n_heldout]


def licence_chunks(tokenizer, max_tokens: int, chunk: int = 256) -> list[list[int]]:
    ids = []
    for name in LICENCES:
        path = Path("/usr/share/common-licenses") / name
        if path.is_file():
            ids += tokenizer.encode(path.read_text())
    ids = ids[:max_tokens]
    return [ids[i:i + chunk] for i in range(0, len(ids) - chunk // 2, chunk)]


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
    engine._drain_inbox()
    t0, last, deadline = time.perf_counter(), 0.0, time.perf_counter() + 60 * minutes
    while engine.scheduler.has_work() and time.perf_counter() < deadline:
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


def subset_ids(data: Data, k: int, vocab_size: int) -> torch.Tensor:
    """The head's k vocabulary ids: the training labels, most frequent first, then the lowest ids the
    data never showed (a BPE vocabulary lists its earliest, most frequent merges first). The head's rows
    are the target's own lm_head rows, so the draft can name a token it never saw as a label."""
    counts = torch.bincount(torch.cat([s.labels[s.labels >= 0] for s in data.train]), minlength=vocab_size).double()
    return (counts + 1.0 / (2 + torch.arange(vocab_size))).topk(k).indices


def draft_tensors(cfg, t: dict[str, torch.Tensor], vocab_ids: torch.Tensor, eh_init: str, seed: int,
                  input_rms: float = 1.0) -> dict:
    """A one-layer draft's starting tensors from the target's f32 tensors `t` (HF names): block = the
    target's last decoder layer, norm = its final norm, head = its lm_head rows for vocab_ids.
    enorm and hnorm start at input_rms, the scale of the residual stream the block was trained on
    (about 30 here, not 1: at 1 its attention and MLP outputs drown the input and training crawls)."""
    h, last = cfg.hidden_size, f"model.layers.{cfg.num_layers - 1}."
    eh = torch.randn(h, 2 * h, generator=torch.Generator().manual_seed(seed)) / math.sqrt(2 * h)  # [e; h] -> H
    if eh_init == "identity":  # the h half passes the target's hidden straight through
        eh[:, :h] *= math.sqrt(2)
        eh[:, h:] = torch.eye(h)
    head = t["model.embed_tokens.weight"] if cfg.tie_word_embeddings else t["lm_head.weight"]
    out = {f"layers.0.block.{n[len(last):]}": v.clone() for n, v in t.items() if n.startswith(last)}
    out.update({"layers.0.enorm.weight": torch.full((h,), input_rms), "layers.0.hnorm.weight": torch.full((h,), input_rms),
                "layers.0.norm.weight": t["model.norm.weight"].clone(), "layers.0.eh_proj.weight": eh,
                "head.weight": head[vocab_ids].clone(), "head.vocab_ids": vocab_ids.clone()})
    return out


@torch.inference_mode()
def residual_rms(engine: Engine, tokens: list[int]) -> float:
    """Median RMS of the residual stream entering the target's last decoder layer over `tokens`."""
    seen, cfg = [], engine.files.config
    hook = engine.model.layers[-1].register_forward_pre_hook(lambda m, a: seen.append(a[0].pow(2).mean(-1).sqrt()))
    engine.model(ForwardBatch.build([Row(0, 0, tokens)]), KVCache(cfg.num_layers, 1, len(tokens), cfg.num_kv_heads,
                                                                   cfg.head_dim))
    hook.remove()
    return float(seen[0].median())


def file_tensors(draft) -> dict[str, torch.Tensor]:
    """The draft's tensors under the file's names (its module names, fused projections split)."""
    out = split_fused({n: b.detach() for n, b in draft.named_buffers() if n.endswith(".weight")}, draft.config)
    out["head.vocab_ids"] = draft.vocab_ids
    return out


def run_row(draft, hidden, emb, positions=None, mask=None):
    """The draft over one row of positions in a fresh cache (causal by default): (block output, logits)."""
    n, cfg = len(hidden), draft.config
    positions = torch.arange(n) if positions is None else positions
    batch = ForwardBatch([Row(0, 0, [0] * n)], torch.zeros(n, dtype=torch.long), positions,
                         [causal_mask(0, n) if mask is None else mask])
    return draft(1, hidden, emb, batch, KVCache(1, 1, n, cfg.num_kv_heads, cfg.head_dim))


@dataclass
class Objective:
    to_subset: torch.Tensor  # [vocab] subset index of each full-vocabulary id, -1 outside
    teacher: torch.Tensor  # [K, H] the target's own lm_head rows of the subset (frozen)
    depth2: float  # weight of the depth-2 terms
    soft: float  # share of the soft term: cross-entropy to the target's distribution over the subset

    @classmethod
    def for_draft(cls, draft, depth2: float, soft: float) -> "Objective":
        to_subset = torch.full((draft.config.vocab_size,), -1, dtype=torch.long)
        to_subset[draft.vocab_ids] = torch.arange(len(draft.vocab_ids))
        return cls(to_subset, draft.head.weight.detach().clone(), depth2, soft)


def padded(seq: Sequence, multiple: int) -> Sequence:
    """`seq` with unlabeled positions appended up to a multiple of `multiple`; attention is causal,
    so they change nothing before them."""
    extra = -len(seq.next_ids) % multiple
    return Sequence(F.pad(seq.hidden, (0, 0, 0, extra)), F.pad(seq.next_ids, (0, extra)),
                    F.pad(seq.labels, (0, extra), value=-1))


def sequence_loss(draft, embed, seq: Sequence, obj: Objective) -> tuple[torch.Tensor, int, int]:
    """Summed loss of one sequence at depth 1 and (weighted) depth 2, with labeled positions and
    depth-1 hits. Autograd cannot go through one KVCache shared by several rows (a row's write
    bumps the version of the storage another row's attention saved), so each sequence gets its own."""
    seq = padded(seq, PAD)
    n = len(seq.next_ids)
    hidden, emb, target = seq.hidden, embed(seq.next_ids), obj.to_subset[seq.labels.clamp(min=0)]
    target[seq.labels < 0] = -1
    positions = mask = None
    if obj.depth2:
        # Depth 2 at position j+1 takes depth 1's block output at j and the token depth 1 should have
        # drafted there; its keys are depth 1's at positions <= j and its own, as in serving.
        with torch.no_grad():
            x1, _ = run_row(draft, hidden, emb)
        drafted = torch.where(seq.labels[:-1] >= 0, seq.labels[:-1], seq.next_ids[1:])
        hidden, emb = torch.cat([hidden, x1[:-1]]), torch.cat([emb, embed(drafted)])
        positions = torch.cat([torch.arange(n), torch.arange(1, n)])
        mask = torch.zeros(2 * n - 1, 2 * n - 1, dtype=torch.bool)
        mask[:n, :n] = causal_mask(0, n)
        mask[n:, :n - 1] = causal_mask(0, n - 1)
        mask[n:, n:] = torch.eye(n - 1, dtype=torch.bool)
    _, logits = run_row(draft, hidden, emb, positions, mask)
    # The target's logits at i+1 (its distribution for x_{i+2}); a labeled position always has i+1 < n.
    teacher = F.linear(torch.cat([seq.hidden[1:], seq.hidden[:1]]), obj.teacher) if obj.soft else None

    def term(logits: torch.Tensor, target: torch.Tensor, shift: int) -> torch.Tensor:
        hard = F.cross_entropy(logits, target, ignore_index=-1, reduction="sum")
        if not obj.soft:
            return hard
        known = seq.labels[shift:shift + len(logits)] >= 0
        soft = -(teacher[shift:shift + len(logits)][known].softmax(-1) * logits[known].log_softmax(-1)).sum()
        return (1 - obj.soft) * hard + obj.soft * soft

    loss = term(logits[:n], target, 0)
    if obj.depth2:
        loss = loss + obj.depth2 * term(logits[n:], target[1:], 1)
    hits = int(((logits[:n].argmax(-1) == target) & (target >= 0)).sum())
    return loss, int((target >= 0).sum()), hits


def train(draft, embed, data: Data, args) -> dict:
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


@torch.no_grad()
def evaluate(draft, embed, seqs: list[Sequence], group: int = 16) -> Evaluation:
    """Teacher-forced over each answer: the chain the server would draft after every answer position q
    (depth 1 from the target's h_q, depths 2 and 3 from the drafted tokens, one cache per sequence as
    in serving). Positions run from the end backwards so that the depth-2/3 writes at q+1, q+2 never
    hide a depth-1 entry that a later (smaller) q still reads."""
    cfg, hit1, n1, covered, chains = draft.config, 0, 0, 0, []
    for g in range(0, len(seqs), group):
        part = seqs[g:g + group]
        cache = KVCache(1, len(part), max(len(s.next_ids) for s in part) + 2, cfg.num_kv_heads, cfg.head_dim)
        batch = ForwardBatch.build([Row(i, 0, s.next_ids.tolist()) for i, s in enumerate(part)])
        x1, logits = draft(1, torch.cat([s.hidden for s in part]), embed(batch.token_ids), batch, cache)
        x1, d1 = x1.split([len(s.next_ids) for s in part]), draft.vocab_ids[logits.argmax(-1)].split(
            [len(s.next_ids) for s in part])
        for s, d in zip(part, d1):
            ok = s.labels >= 0
            hit1, n1 = hit1 + int((d[ok] == s.labels[ok]).sum()), n1 + int(ok.sum())
            covered += int(torch.isin(s.labels[ok], draft.vocab_ids).sum())
        qs = [[q for q in range(len(s.labels) - 3, -1, -1) if bool((s.labels[q:q + 3] >= 0).all())] for s in part]
        for t in range(max(len(q) for q in qs)):
            active = [i for i in range(len(part)) if t < len(qs[i])]
            q = [qs[i][t] for i in active]
            tok = torch.stack([d1[i][qi] for i, qi in zip(active, q)])
            h = torch.stack([x1[i][qi] for i, qi in zip(active, q)])
            drafts = [tok]
            for depth in (2, 3):
                rows = ForwardBatch.build([Row(i, qi + depth - 1, [0]) for i, qi in zip(active, q)])
                h, logits = draft(depth, h, embed(tok), rows, cache)
                tok = draft.vocab_ids[logits.argmax(-1)]
                drafts.append(tok)
            truth = torch.stack([torch.stack([part[i].labels[qi + k] for i, qi in zip(active, q)]) for k in range(3)])
            chains.append(torch.stack(drafts) == truth)  # [3, active]
    ok = torch.cat(chains, dim=1).float()
    run = ok.cumprod(0)  # run[k]: the first k+1 drafts all accepted
    return Evaluation(n1, covered / n1, hit1 / n1, float(run[1].sum() / run[0].sum()), float(run[2].sum() / run[1].sum()),
                      {n: round(float(run[:n].sum(0).mean()), 3) for n in (1, 2, 3)})


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    draft = mtp.MTPDraft(cfg, start, 1, "f32", 2 * (max_len + PAD))
    fingerprint = mtp.target_fingerprint(cfg, target["model.embed_tokens.weight"])
    # The file's f32 embedding, frozen and shared with the target whatever format generated the data.
    embed = torch.nn.Embedding.from_pretrained(target["model.embed_tokens.weight"])
    del target
    result = train(draft, embed, data, args)
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
    loaded = mtp.MTPDraft(cfg, mtp.load_tensors(args.out), 1, "f32", draft.cos.shape[0])
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
