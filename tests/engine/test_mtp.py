"""An MTP draft file round-trips: what `python -m train` saves loads back into MTPDraft with the same
logits, and a draft made for another target is refused with a message that says why."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from engine import settings
from engine.cli.tiny import tiny_config, write_tiny_model
from engine.errors import ConfigError
from engine.files.weights import open_model
from engine.model import mtp
from engine.model.batch import ForwardBatch, Row
from engine.model.kv_cache import KVCache
from engine.model.layer_spec import DENSE
from engine.settings import DEFAULT_DRAFT
from train.draft import draft_tensors

SUBSET = 64


def tiny_target(tmp_path_factory, name: str = "llama", seed: int = 0, **overrides):
    config = tiny_config(name, **overrides)
    files = open_model(write_tiny_model(config, tmp_path_factory.mktemp(f"{name}-{seed}"), seed=seed))
    tensors = files.load_tensors()
    return files.config, tensors, mtp.target_fingerprint(files.config, tensors["model.embed_tokens.weight"])


def save_draft(path: Path, config, tensors, fingerprint: str, seed: int = 0) -> dict[str, torch.Tensor]:
    draft = draft_tensors(config, tensors, torch.randperm(config.vocab_size)[:SUBSET], "random", seed)
    mtp.save(path, draft, num_layers=1, fingerprint=fingerprint, target_name="tiny", dtype=torch.bfloat16)
    return draft


def subset_logits(draft: mtp.MTPDraft, hidden: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    cfg = draft.config
    batch = ForwardBatch.build([Row(0, 0, tokens.tolist())])
    with torch.no_grad():
        embeddings = torch.randn(len(tokens), cfg.hidden_size, generator=torch.Generator().manual_seed(1))
        return draft(1, hidden, embeddings, batch, KVCache(1, 1, len(tokens), cfg.num_kv_heads, cfg.head_dim))[1]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return tiny_target(tmp_path_factory)


def test_saved_draft_loads_back_with_the_same_logits(target, tmp_path):
    config, tensors, fingerprint = target
    made = save_draft(tmp_path / "draft.safetensors", config, tensors, fingerprint)
    # The file holds bf16: the draft as trained, rounded once, is what must come back.
    rounded = {n: t if n == "head.vocab_ids" else t.to(torch.bfloat16).float() for n, t in made.items()}
    loaded = mtp.load_tensors(tmp_path / "draft.safetensors")
    assert loaded.keys() == made.keys()
    assert torch.equal(loaded["head.vocab_ids"], made["head.vocab_ids"])
    hidden, tokens = torch.randn(12, config.hidden_size), torch.arange(12)
    expected = subset_logits(mtp.MTPDraft(config, rounded, [DENSE], "f32", 64), hidden, tokens)
    assert torch.equal(subset_logits(mtp.MTPDraft(config, loaded, [DENSE], "f32", 64), hidden, tokens), expected)
    header = mtp.read_header(tmp_path / "draft.safetensors")
    assert (header.num_layers, header.hidden_size, header.subset_size) == (1, config.hidden_size, SUBSET)
    mtp.check_compatible(header, tmp_path / "draft.safetensors", config, fingerprint)  # its own target: accepted


def test_draft_for_another_target_is_refused(target, tmp_path, tmp_path_factory):
    config, tensors, fingerprint = target
    other_config, other_tensors, other_fingerprint = tiny_target(tmp_path_factory, seed=1)  # same geometry
    path = tmp_path / "other.safetensors"
    save_draft(path, other_config, other_tensors, other_fingerprint)
    with pytest.raises(ConfigError, match=re.escape(
            f"trained for another target (tiny, fingerprint {other_fingerprint}): a draft serves only the target "
            f"whose fingerprint it carries; this target's fingerprint is {fingerprint}")):
        mtp.check_compatible(mtp.read_header(path), path, config, fingerprint)


def test_draft_of_another_hidden_size_is_refused(target, tmp_path, tmp_path_factory):
    config, tensors, fingerprint = target
    wide = tiny_target(tmp_path_factory, hidden_size=96, seed=2)
    path = tmp_path / "wide.safetensors"
    save_draft(path, *wide)
    rule = re.escape(f"trained for another target (tiny, hidden size 96): a draft serves only the target whose "
                     f"fingerprint it carries; this target's hidden_size is {config.hidden_size}")
    with pytest.raises(ConfigError, match=rule):
        mtp.check_compatible(mtp.read_header(path), path, config, fingerprint)
    with pytest.raises(ConfigError, match=rule):  # from the headers alone, before the target's weights are read
        mtp.check_compatible(mtp.read_header(path), path, config, "")


def test_the_shipped_draft_is_package_data_of_the_engine():
    """A plain (not editable) `pip install .` copies only what pyproject's package-data names."""
    import tomllib
    from fnmatch import fnmatch
    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    engine_dir = Path(settings.__file__).parent
    relative = DEFAULT_DRAFT.relative_to(engine_dir).as_posix()
    assert any(fnmatch(relative, pattern) for pattern in pyproject["tool"]["setuptools"]["package-data"]["engine"])
    assert mtp.read_header(DEFAULT_DRAFT).target_name  # the file itself, not an LFS pointer


def test_a_file_that_is_not_a_draft_is_refused(tmp_path):
    from safetensors.torch import save_file
    save_file({"x": torch.zeros(2)}, str(tmp_path / "plain.safetensors"))
    with pytest.raises(ConfigError, match="not a tandem MTP draft"):
        mtp.read_header(tmp_path / "plain.safetensors")
    with pytest.raises(ConfigError, match="does not exist"):
        mtp.read_header(tmp_path / "missing.safetensors")


@pytest.mark.parametrize("dtype, draft_weights", [("f32", torch.int8), ("int8", torch.int8), ("auto", torch.int8),
                                                  ("bf16", torch.bfloat16), ("q4_1", torch.uint8)])
def test_the_draft_streams_int8_weights_beside_a_target_computing_in_f32(target, tmp_path, dtype, draft_weights):
    # It only proposes, so its precision cannot change the output; its weights are read once per
    # drafted token, and int8 reads a quarter of f32's bytes. Its activations stay in the target's dtype.
    # A target in a block format (q4_1 here) gets its draft in that format, quantized on load.
    from engine.model.transformer import Transformer
    from engine.settings import SpecConfig
    from engine.spec.loading import check_draft_files, load_drafter
    config, tensors, fingerprint = target
    save_draft(tmp_path / "draft.safetensors", config, tensors, fingerprint)
    spec = SpecConfig(pacing=False, type="draft-mtp", draft_model=str(tmp_path / "draft.safetensors"))
    model = Transformer(config, tensors, dtype, max_positions=64)
    drafter = load_drafter(spec, check_draft_files(spec, config), config, tensors, dtype, slots=1, ctx_per_slot=64,
                           target_embed=model.embed_tokens)
    layer = drafter.model.layers[0]
    assert layer.eh_proj.weight.dtype == drafter.model.head.weight.dtype == draft_weights
    assert drafter.cache.k[0].dtype == model.compute_dtype
