"""Which drafter a SpecConfig asks for: its files checked from headers, then loaded with its cache."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.errors import ConfigError
from engine.files.model_config import ModelConfig
from engine.files.weights import ModelFiles, open_model
from engine.model import mtp
from engine.model.kv_cache import KVCache
from engine.model.layer_spec import LayerSpec
from engine.model.transformer import Transformer, embedding_table
from engine.ops.blocks import FORMATS
from engine.ops.quant import compute_dtype, keeps_blocks
from engine.placement import Placement
from engine.settings import SpecConfig
from engine.spec.draft_model import DraftModelDrafter
from engine.spec.drafter import Drafter
from engine.spec.mtp import MTPDrafter, MTPNgramDrafter
from engine.spec.ngram import NgramDrafter


@dataclass(frozen=True)
class DraftFiles:
    """The draft's headers, read once before any weights (check_draft_files) and kept for the fit
    estimate and the load."""
    mtp: mtp.MTPHeader | None = None  # a detached MTP draft's
    model: ModelFiles | None = None  # a draft model's (draft-simple)

    @property
    def ratios(self) -> tuple[int, ...]:
        """The compress ratios of a detached MTP draft's layers (empty for other drafters)."""
        return self.mtp.compress_ratios if self.mtp is not None else ()


def check_draft_files(spec: SpecConfig, target: ModelConfig) -> DraftFiles:
    """Header-level checks of the draft, before any weights are read."""
    if spec.runs_mtp:
        header = mtp.read_header(spec.draft_model)
        mtp.check_compatible(header, spec.draft_model, target, "")
        return DraftFiles(mtp=header)
    if spec.type == "draft-simple":
        files = open_model(spec.draft_model)
        if files.config.vocab_size != target.vocab_size:
            raise ConfigError(f"spec_draft_model={spec.draft_model!r}: vocabulary of {files.config.vocab_size} "
                              f"tokens differs from the target's {target.vocab_size}")
        return DraftFiles(model=files)
    return DraftFiles()


def load_drafter(spec: SpecConfig, files: DraftFiles, config: ModelConfig, target_tensors: dict, dtype: str,
                 slots: int, ctx_per_slot: int, draft_ratios: tuple[int, ...] = (), device: str = "cpu",
                 target_embed=None) -> Drafter:
    """The drafter for `spec`, its headers as check_draft_files read them, with its own cache where
    it keeps one, all on `device`, for a target of `config` whose tensors include at least its
    embedding. draft_ratios: a detached MTP draft's layers' compress ratios as --compress-ratios gave
    them (engine.preflight; empty: the file's). target_embed: the target's embed_tokens where its
    table sits on `device` (an MTP draft then embeds with it; None: with a copy of its own)."""
    if spec.type == "ngram-simple":
        return NgramDrafter(spec.ngram_n, config.vocab_size)
    if spec.runs_mtp:
        header = files.mtp
        fingerprint = mtp.target_fingerprint(config, target_tensors["model.embed_tokens.weight"])
        mtp.check_compatible(header, spec.draft_model, config, fingerprint)
        # The draft only proposes (the target decides every token), and its weights are read once
        # per drafted token: in f32 they cost a quarter of what int8 does, for the same proposals
        # nearly always. So a target computing in f32 (f32, int8, auto) gets an int8 draft, and
        # one in a block format a draft in that format (quantized on load: the file is f32).
        draft_dtype = dtype if dtype in FORMATS else "int8" if compute_dtype(dtype) == torch.float32 else dtype
        specs = [LayerSpec.of(r, config.qsa_budget) for r in draft_ratios or header.compress_ratios]
        embed = None if target_embed is not None else embedding_table(config, target_tensors, dtype).to(device)
        draft = mtp.MTPDraft(config, mtp.load_tensors(spec.draft_model), specs, draft_dtype, ctx_per_slot, device,
                             embed)
        cache = KVCache(len(specs), slots, ctx_per_slot, config.num_kv_heads, config.head_dim, compute_dtype(dtype),
                        specs=specs, devices=[device] * len(specs))
        drafter = MTPDrafter(draft, target_embed or draft.embed_tokens, cache, config.vocab_size, spec.width,
                             spec.p_sibling)
        return MTPNgramDrafter(drafter, spec.ngram_n) if spec.type == "draft-mtp-ngram" else drafter
    c = files.model.config
    model = Transformer(c, files.model.load_tensors(keep_blocks=keeps_blocks(dtype)), dtype,
                        max_positions=max(ctx_per_slot, c.max_position_embeddings),
                        placement=Placement.single(c.num_layers, device))
    cache = KVCache(c.num_layers, slots, ctx_per_slot, c.num_kv_heads, c.head_dim, compute_dtype(dtype),
                    specs=model.specs, devices=[device] * c.num_layers)
    return DraftModelDrafter(model, cache, config.vocab_size, spec.width, spec.p_sibling)
