"""Qwen4-Exp's own MTP layer as a draft (transformers drops its `mtp.*` weights):
docs/architecture.md, "Qwen4-Exp's own MTP". It runs in the frame of Qwen3.5's (engine/model/qwen3_5.py
NextN: cache position p pairs the token at p with the target's hidden state at p - 1, zeros before
position 0); what differs is how the token and the hidden enter, the block, and the head."""
from __future__ import annotations

import torch

from engine.files.model_config import ModelConfig
from engine.model.hyper_connections import HyperConnection
from engine.model.norm import RMSNorm
from engine.model.qwen3_5 import NextN
from engine.ops import blocks
from engine.ops.quant import Linear


class Qwen4ExpNextN(NextN):
    """Qwen4-Exp's own MTP layer (docs/architecture.md, "Qwen4-Exp's own MTP"): for hidden h, the
    target's residual streams [N, hc * hidden] (or the previous depth's), and token x:

        u = fc_embedding(enorm(embed(x)));  n = hnorm(h) over all streams at once
        x'_s = fc_hidden(n_s) + u for each stream s;  G = layer(x')  (a dense Qwen4-Exp layer)
        logits = lm_head(mixer(G))

    with its own stream mixer and the target's lm_head and embedding; a deeper step reads G."""

    def build(self, c: ModelConfig, t: dict, dtype: str) -> None:
        cdt, eps, d = self.compute_dtype, c.rms_norm_eps, self.device
        self.streams, self.hidden = c.hc_count, c.hidden_size
        self.enorm = RMSNorm(t["mtp.pre_fc_norm_embedding.weight"], eps, cdt).to(d)
        self.hnorm = RMSNorm(t["mtp.pre_fc_norm_hidden.weight"], eps, cdt).to(d)
        if "mtp.fc.weight" in t:  # a GGUF's eh_proj: [fc_embedding | fc_hidden] along the input
            fc = blocks.to_f32(t["mtp.fc.weight"])
            embedding, hidden = fc[:, :self.hidden].contiguous(), fc[:, self.hidden:].contiguous()
        else:
            embedding, hidden = t["mtp.fc_embedding.weight"], t["mtp.fc_hidden.weight"]
        self.fc_embedding = Linear(embedding, None, dtype).to(d)
        self.fc_hidden = Linear(hidden, None, dtype).to(d)
        self.mixer = HyperConnection(c, t, "mtp.hyper_connection_mixer.", dtype, inject=False).to(d)

    def combine(self, embeddings: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        u = self.fc_embedding(self.enorm(embeddings))  # [N, hidden]
        streams = self.fc_hidden(self.hnorm(hidden).view(-1, self.hidden)).view(-1, self.streams, self.hidden)
        return (streams + u.unsqueeze(1)).flatten(1)

    def after_block(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def head_logits(self, rows: torch.Tensor) -> torch.Tensor:
        return self.target_logits(self.mixer.mix(rows)[0])
