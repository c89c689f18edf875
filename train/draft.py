"""The draft being trained: its starting tensors from the target's, the head's vocabulary subset,
its tensors under the file's names, and one run of it over a row of positions."""
from __future__ import annotations

import math

import torch

from engine import Engine
from engine.model.batch import ForwardBatch, Row, causal_mask
from engine.model.kv_cache import KVCache
from engine.model.fused import split_fused
from train.data import Data


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
