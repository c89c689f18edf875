"""Held-out evaluation of the chain the server drafts: depth-1 accuracy, the acceptance of depths 2
and 3 given the ones before, and the mean tokens per verify step."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.model.batch import ForwardBatch, Row
from engine.model.kv_cache import KVCache
from train.data import Sequence


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
