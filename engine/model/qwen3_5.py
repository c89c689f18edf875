"""Qwen3.5's own MTP layer (transformers drops its `mtp.*` weights; llama.cpp's qwen35 runs it as the
`nextn` layer behind --spec-type draft-mtp), as a draft: docs/architecture.md, "The model's own MTP";
the frame Qwen4-Exp's (engine/model/qwen4_exp.py) shares.

Its cache position p pairs the token at p with the target's hidden state at p - 1 (zeros before
position 0), as llama.cpp's draft-mtp does. One step, for hidden h and token x:

    x' = fc([enorm(embed(x)); hnorm(h)]);  x' = block(x');  h' = norm(x');  logits = head(h')

block: a full-attention decoder layer of the model's own kind (gated attention, partial RoPE) with a
KV cache of its own; norm: the layer's `mtp.norm` (GGUF's shared_head_norm); head: its own
shared_head if the file has one, else the target's lm_head; embed: its own embed_tokens, else the
target's. A deeper step reads the previous step's h' (after norm) with the token it drafted. A model
with several MTP layers runs layer k at depth k + 1, its last for the deeper ones.
"""
from __future__ import annotations

import torch
from torch import nn

from engine.files.model_config import ModelConfig
from engine.model.batch import ForwardBatch
from engine.model.layer_spec import DENSE
from engine.model.norm import RMSNorm
from engine.model.rope import rope_table
from engine.model.transformer import decoder_layer, embed_rows, run_on
from engine.ops.arena import move_to_huge_pages
from engine.ops.quant import Linear, compute_dtype


class NextN(nn.Module):
    """The model's MTP layers from their tensors (engine/files/qwen3_5_layout.py names), with the
    target's lm_head and embedding where the file has no head or embedding of its own."""
    vocab_ids = None  # its logits cover the whole vocabulary

    def __init__(self, c: ModelConfig, t: dict, dtype: str, max_positions: int, target_logits, embed_tokens,
                 device: str = "cpu"):
        """target_logits: [N, hidden] -> [N, vocab] f32 on the CPU, the target's lm_head
        (Transformer.head_logits); embed_tokens: [N] ids -> [N, hidden] on `device`, the target's
        table or a copy there. Both are the target's, not this module's: they are not copied again."""
        super().__init__()
        cdt = compute_dtype(dtype)
        self.config, self.num_layers, self.device = c, c.num_nextn_predict_layers, torch.device(device)
        self.compute_dtype = cdt
        cos, sin = rope_table(c.rope, c.rotary_dim, max_positions)
        self.register_buffer("cos", cos.to(cdt))
        self.register_buffer("sin", sin.to(cdt))
        self.target_logits = target_logits
        own_embed = t.get("mtp.embed_tokens.weight")
        self.own_embed = Linear(own_embed, None, dtype).to(self.device) if own_embed is not None else None
        self.target_embed = embed_tokens
        self.blocks = nn.ModuleList(
            decoder_layer(c, {f"model.layers.{k}.{n[len(p):]}": v for n, v in t.items() if n.startswith(p)}, k,
                          dtype, DENSE, (self.cos, self.sin), c.num_layers + k).to(self.device)
            for k, p in ((k, f"mtp.layers.{k}.") for k in range(self.num_layers)))
        self.build(c, t, dtype)
        move_to_huge_pages(self)

    def build(self, c: ModelConfig, t: dict, dtype: str) -> None:
        """The family's own tensors around the blocks: [enorm(embedding); hnorm(hidden)] -> fc, the
        norm after the block, and a head of its own where the file has one."""
        cdt, eps, d = self.compute_dtype, c.rms_norm_eps, self.device
        self.enorm = RMSNorm(t["mtp.pre_fc_norm_embedding.weight"], eps, cdt).to(d)
        self.hnorm = RMSNorm(t["mtp.pre_fc_norm_hidden.weight"], eps, cdt).to(d)
        self.fc = Linear(t["mtp.fc.weight"], None, dtype).to(d)
        self.norm = RMSNorm(t["mtp.norm.weight"], eps, cdt).to(d)
        own_head = t.get("mtp.shared_head.weight")
        self.head = Linear(own_head, None, dtype).to(d) if own_head is not None else None

    def combine(self, embeddings: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The block's input from the tokens' embeddings and the hidden states they pair with."""
        return self.fc(torch.cat([self.enorm(embeddings), self.hnorm(hidden)], dim=-1))

    def after_block(self, x: torch.Tensor) -> torch.Tensor:
        """What a step hands on (to the head and the next depth): the block's output normed."""
        return self.norm(x)

    def head_logits(self, rows: torch.Tensor) -> torch.Tensor:
        return self.target_logits(rows) if self.head is None else self.head(rows).float().cpu()

    @property
    def specs(self):
        return [DENSE] * self.num_layers

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        if self.own_embed is not None:
            return embed_rows(self.own_embed, ids, self.compute_dtype)
        return self.target_embed(ids)

    def layer_for_depth(self, depth: int) -> int:
        return min(depth, self.num_layers) - 1

    def forward(self, depth: int, hidden: torch.Tensor, embeddings: torch.Tensor, batch: ForwardBatch,
                cache, at: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden, embeddings: [N, H] for the batch's N positions (position p: the token there and
        the hidden state before it). Writes this depth's layer cache. Returns (h' after norm [N, H],
        full-vocabulary logits f32 on the CPU at the positions `at` indexes, or at all)."""
        d, block = self.device, self.blocks[self.layer_for_depth(depth)]
        x = self.combine(embeddings.to(d), hidden.to(d))
        x = self.after_block(run_on(d, [block], x, batch, self.cos[batch.positions], self.sin[batch.positions],
                                    cache))
        return x, self.head_logits(x if at is None else x[at.to(d)])
