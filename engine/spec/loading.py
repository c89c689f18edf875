"""Which drafter a SpecConfig asks for: its files checked from headers, then loaded with its cache."""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from engine.errors import ConfigError
from engine.files.model_config import ModelConfig
from engine.files.weights import ModelFiles, open_model
from engine.model import mtp
from engine.model.kv_cache import KVCache, model_cache
from engine.model.layer_spec import LayerSpec
from engine.model.qwen3_5 import NextN
from engine.model.qwen4_exp_mtp import Qwen4ExpNextN
from engine.model.transformer import Transformer, embed_rows, embedding_table
from engine.ops import blocks
from engine.ops.blocks import FORMATS, BlockTensor
from engine.ops.quant import Linear, compute_dtype, keeps_blocks
from engine.placement import Placement
from engine.settings import SpecConfig
from engine.spec.draft_model import DraftModelDrafter
from engine.spec.drafter import Drafter
from engine.spec.mtp import MTPDrafter, MTPNgramDrafter, NextNDrafter
from engine.spec.ngram import NgramDrafter


@dataclass(frozen=True)
class DraftFiles:
    """The draft's headers, read once before any weights (check_draft_files) and kept for the fit
    estimate and the load."""
    mtp: mtp.MTPHeader | None = None  # a detached MTP draft's (tandem's own file)
    model: ModelFiles | None = None  # a draft model's (draft-simple)
    nextn: ModelFiles | None = None  # the file holding the model's own MTP layers: the target's, or -md's

    @property
    def ratios(self) -> tuple[int, ...]:
        """The compress ratios of a detached MTP draft's layers (empty for other drafters)."""
        return self.mtp.compress_ratios if self.mtp is not None else ()


def check_draft_files(spec: SpecConfig, target: ModelConfig, files: ModelFiles | None = None) -> DraftFiles:
    """Header-level checks of the draft, before any weights are read; files: the target's, where
    its own MTP layers are. An MTP draft is the model's own MTP layers without -md, or from -md
    naming a model file (HF directory or GGUF, an MTP-only GGUF included); else -md names tandem's
    detached draft file."""
    if spec.runs_mtp and spec.draft_model is None:
        if files is None or not files.has_mtp:
            raise ConfigError(f"spec_draft_model=None: is required with spec_type={spec.type} unless the model "
                              f"carries its own MTP layers, and {files.path if files else 'this one'} has none")
        return DraftFiles(nextn=files)
    if spec.runs_mtp and _is_model_file(spec.draft_model):
        own = open_model(spec.draft_model, trunk=False)
        _check_nextn(own, spec.draft_model, target)
        return DraftFiles(nextn=own)
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


def _is_model_file(path: str) -> bool:
    p = Path(path)
    return p.is_dir() or p.suffix == ".gguf" or (p.is_file() and p.open("rb").read(4) == b"GGUF")


def _check_nextn(own: ModelFiles, path: str, target: ModelConfig) -> None:
    """A model file given as the MTP draft must hold MTP layers made for a model of the target's
    geometry (an MTP-only GGUF converted from the same checkpoint, or the checkpoint itself)."""
    c = own.config
    if not own.has_mtp:
        raise ConfigError(f"spec_draft_model={path!r}: holds no MTP layers (no mtp.* / blk.N.nextn.* tensors)")
    theirs = (c.family, c.hidden_size, c.vocab_size, c.num_heads, c.num_kv_heads, c.head_dim)
    ours = (target.family, target.hidden_size, target.vocab_size, target.num_heads, target.num_kv_heads,
            target.head_dim)
    if theirs != ours:
        raise ConfigError(f"spec_draft_model={path!r}: MTP layers for another model ({c.family}, hidden {c.hidden_size}, "
                          f"vocab {c.vocab_size}); this target is {target.family}, hidden {target.hidden_size}, "
                          f"vocab {target.vocab_size}")


def load_drafter(spec: SpecConfig, files: DraftFiles, config: ModelConfig, target_tensors: dict, dtype: str,
                 slots: int, ctx_per_slot: int, draft_ratios: tuple[int, ...] = (), device: str = "cpu",
                 target_embed=None, target_logits=None) -> Drafter:
    """The drafter for `spec`, its headers as check_draft_files read them, with its own cache where
    it keeps one, all on `device`, for a target of `config` whose tensors include at least its
    embedding. draft_ratios: a detached MTP draft's layers' compress ratios as --compress-ratios gave
    them (engine.preflight; empty: the file's). target_embed: the target's embed_tokens where its
    table sits on `device` (an MTP draft then embeds with it; None: with a copy of its own).
    target_logits: the target's lm_head ([N, hidden] -> [N, vocab] f32 on the CPU), which the
    model's own MTP layers share."""
    if spec.type == "ngram-simple":
        return NgramDrafter(spec.ngram_n, config.vocab_size)
    if spec.runs_mtp:
        embed = None if target_embed is not None else embedding_table(config, target_tensors, dtype).to(device)
        if files.nextn is not None:
            draft, specs = _nextn(files.nextn, config, target_tensors, dtype, ctx_per_slot, device,
                                  target_logits or _lm_head(config, target_tensors, dtype, device),
                                  target_embed or (lambda ids: embed_rows(embed, ids, compute_dtype(dtype))))
            positions, drafter_type = ctx_per_slot + 1, NextNDrafter  # its positions stand one after the target's
        else:
            draft, specs = _detached_mtp(spec, files.mtp, config, target_tensors, dtype, ctx_per_slot, draft_ratios,
                                         device, embed)
            positions, drafter_type = ctx_per_slot, MTPDrafter
        cache = KVCache(len(specs), slots, positions, config.num_kv_heads, config.head_dim, compute_dtype(dtype),
                        specs=specs, devices=[device] * len(specs))
        drafter = drafter_type(draft, target_embed or draft.embed_tokens, cache, config.vocab_size, spec.width,
                               spec.p_sibling)
        return MTPNgramDrafter(drafter, spec.ngram_n) if spec.type == "draft-mtp-ngram" else drafter
    c = files.model.config
    model = Transformer(c, files.model.load_tensors(keep_blocks=keeps_blocks(dtype)), dtype,
                        max_positions=max(ctx_per_slot, c.max_position_embeddings),
                        placement=Placement.single(c.num_layers, device))
    # A recurrent draft model keeps the states of its drafted positions and of the span before them.
    cache = model_cache(c, model.specs, slots, ctx_per_slot, spec.n_max + 2, compute_dtype(dtype), device)
    return DraftModelDrafter(model, cache, config.vocab_size, spec.width, spec.p_sibling)


def _detached_mtp(spec: SpecConfig, header: mtp.MTPHeader, config: ModelConfig, target_tensors: dict, dtype: str,
                  ctx_per_slot: int, draft_ratios: tuple[int, ...], device: str, embed) -> tuple:
    fingerprint = mtp.target_fingerprint(config, target_tensors["model.embed_tokens.weight"])
    mtp.check_compatible(header, spec.draft_model, config, fingerprint)
    # The draft only proposes (the target decides every token), and its weights are read once
    # per drafted token: in f32 they cost a quarter of what int8 does, for the same proposals
    # nearly always. So a target computing in f32 (f32, int8, auto) gets an int8 draft, and
    # one in a block format a draft in that format (quantized on load: the file is f32).
    draft_dtype = dtype if dtype in FORMATS else "int8" if compute_dtype(dtype) == torch.float32 else dtype
    specs = [LayerSpec.of(r, config.qsa_budget) for r in draft_ratios or header.compress_ratios]
    return mtp.MTPDraft(config, mtp.load_tensors(spec.draft_model), specs, draft_dtype, ctx_per_slot, device,
                        embed), specs


def _nextn(files: ModelFiles, config: ModelConfig, target_tensors: dict, dtype: str, ctx_per_slot: int, device: str,
           target_logits, embed_tokens) -> tuple:
    """The model's own MTP layers, in the target's weight format: a draft that proposes what
    llama.cpp's draft-mtp over the same file proposes."""
    tensors = files.load_mtp(keep_blocks=keeps_blocks(dtype))
    embedding = "model.embed_tokens.weight"
    if embedding in files.shapes and embedding not in tensors:  # an MTP-only file: made from this target?
        _check_same_embedding(files, target_tensors[embedding])
    kind = Qwen4ExpNextN if config.family == "qwen4_exp" else NextN
    # The layers are the file's, dense: a target converted without them (-md then gives them) counts none.
    k = files.config.num_nextn_predict_layers
    ratios = config.compress_ratios[:config.num_layers] + (0,) * k if config.compress_ratios else ()
    layers = replace(config, num_nextn_predict_layers=k, compress_ratios=ratios)
    draft = kind(layers, tensors, dtype, ctx_per_slot + 1, target_logits, embed_tokens, device)
    return draft, draft.specs


def _lm_head(config: ModelConfig, target_tensors: dict, dtype: str, device: str):
    """The target's lm_head as a function, where the draft runs without the target beside it (its own rank)."""
    head = Linear(target_tensors["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"],
                  None, dtype).to(device)
    return lambda hidden: head(hidden.to(head.weight.device)).float().cpu()


def _check_same_embedding(files: ModelFiles, target: torch.Tensor | BlockTensor, rows: int = 64) -> None:
    """The MTP file's embedding's first rows point the way the target's do (a file converted from
    the same checkpoint, maybe in another weight format): the draft shares the target's table."""
    name = "model.embed_tokens.weight"
    own = files.read({name: files.shapes[name]})[name][:rows].flatten()
    theirs = blocks.to_f32(blocks.take_rows(target, torch.arange(rows))).flatten()
    similarity = float(torch.nn.functional.cosine_similarity(own, theirs, dim=0))
    if similarity < 0.99:
        raise ConfigError(f"spec_draft_model={str(files.path)!r}: its embedding is not the target's (cosine "
                          f"similarity of the first {rows} rows {similarity:.3f}): an MTP file serves the model it "
                          "was converted from")
