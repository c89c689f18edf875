"""The MTP drafts as drafters (`draft-mtp`): tandem's detached file, or the model's own MTP layers;
and either with the n-gram lookup beside it (`draft-mtp-ngram`)."""
from __future__ import annotations

import torch

from engine.model.batch import ForwardBatch, Row
from engine.model.kv_cache import KVCache
from engine.sched.request import Draft, Request
from engine.spec.drafter import CachedDrafter, Span, top_tokens
from engine.spec.ngram import lookup_draft, ngram_draft


class MTPDrafter(CachedDrafter):
    """The detached MTP draft: position i of its cache holds (target hidden h_i, token x_{i+1})."""
    needs_hidden = True

    def __init__(self, draft, embed_tokens, cache, vocab: int, width: int = 1, p_sibling: float = 0.0):
        """embed_tokens: [N] ids -> [N, hidden] on the draft's device (the target's table, or the draft's copy)."""
        super().__init__(cache, vocab, width, p_sibling)
        self.model, self.embed_tokens = draft, embed_tokens
        self.vocab_ids = draft.vocab_ids

    def catch_up_rows(self, span: Span):
        ids = span.request.token_ids
        return Row(span.request.slot, span.start, ids[span.start + 1:span.end + 1]), span.hidden

    def run(self, depth, rows, hidden, at=None):
        batch = ForwardBatch.build(rows)
        embeddings = self.embed_tokens(batch.token_ids)
        return self.model(depth, hidden.to(embeddings.dtype), embeddings, batch, self.cache, at)


class NextNDrafter(MTPDrafter):
    """The model's own MTP layers (engine/model/qwen3_5.py NextN), as llama.cpp's draft-mtp runs them:
    cache position p pairs the token at p with the target's hidden state at p - 1, one position
    after where the detached draft's pairing stands, and position 0 pairs the first token with zeros."""

    def catch_up_rows(self, span: Span):
        req, ids = span.request, span.request.token_ids
        if span.start == 0:
            zeros = span.hidden.new_zeros(1, span.hidden.shape[1])
            return Row(req.slot, 0, ids[:span.end + 1]), torch.cat([zeros, span.hidden])
        return Row(req.slot, span.start + 1, ids[span.start + 1:span.end + 1]), span.hidden


class MTPNgramDrafter:
    """draft-mtp-ngram: the MTP draft, or the n-gram lookup's continuation where the context offers
    one the draft agrees with. Per request and step, after the MTP draft has caught up on the
    committed span (its cache must see every position), the lookup's continuation (at least n_min
    tokens) is the draft when its first token is the MTP draft's depth-1 top-1 token, or when that
    top-1 probability is below p_min (the MTP draft would propose nothing); otherwise the MTP
    draft drafts as draft-mtp does. The rule reads the top-1 token, never a sampled one, so a
    sampling request's one-hot q is the distribution its n-gram draft was really drawn from."""
    needs_hidden = True
    has_cache = True

    def __init__(self, mtp_drafter: MTPDrafter, ngram_n: int):
        self.mtp, self.ngram_n = mtp_drafter, ngram_n
        self.lookup_drafts = 0  # drafts the n-gram lookup gave: how often it won

    def draft(self, spans: list[Span]) -> dict[Request, Draft]:
        return self.mtp.draft(spans, self._lookup)

    def resident(self) -> tuple[torch.nn.Module, KVCache]:
        return self.mtp.resident()

    def _lookup(self, span: Span, logits: torch.Tensor, limit: int) -> Draft | None:
        req = span.request
        tokens = ngram_draft(req.token_ids, self.ngram_n, limit)
        if not tokens or len(tokens) < req.draft_limits.n_min:
            return None
        (ranked,), (probs,) = top_tokens(logits[None], self.mtp.vocab_ids, 1)
        if tokens[0] != ranked[0] and probs[0] >= req.draft_limits.p_min:
            return None
        self.lookup_drafts += 1
        return lookup_draft(req, tokens, self.mtp.vocab)
