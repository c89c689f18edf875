"""Tree verify rows (engine/model/batch.py, docs/architecture.md "Trees"): a sibling written at a scratch
position past the chain attends as the chain node it stands for, on the whole-layer kernel and the
layer-by-layer path alike, and once kept, its K/V moves down to the position it was verified for."""
from __future__ import annotations

import pytest
import torch

from engine.cli.tiny import write_tiny_model
from engine.errors import ConfigError
from engine.files.model_config import with_compression
from engine.files.weights import open_model
from engine.model import transformer
from engine.model.batch import ForwardBatch, Row, tree_mask
from engine.model.kv_cache import KVCache, PagedKVCache
from engine.model.transformer import Transformer
from engine.ops import kernels
from engine.sched.request import Request
from engine.sched.sampling import SamplingParams
from engine.settings import CompressRatios, DraftLimits, SpecConfig
from engine.spec.drafter import CachedDrafter, Span
from tests.engine.test_parity import tiny_config

PROMPT = list(range(3, 14))


def test_a_tree_mask_shows_each_node_the_chain_before_its_depth_and_itself():
    # Two tokens of prefix; chain a (depth 0), b (1), c (2); siblings of b (depth 1) and of c (2).
    mask = tree_mask(2, [0, 1, 2, 1, 2]).int().tolist()
    assert mask == [[1, 1, 1, 0, 0, 0, 0],
                    [1, 1, 1, 1, 0, 0, 0],
                    [1, 1, 1, 1, 1, 0, 0],
                    [1, 1, 1, 0, 0, 1, 0],
                    [1, 1, 1, 1, 0, 0, 1]]


def take_path(monkeypatch, fused: bool) -> list[int]:
    """Steps run on the whole-layer kernel (fused) or layer by layer; the kernel's calls' row counts."""
    calls = []
    if fused:
        kernel = kernels.decoder_layers
        monkeypatch.setattr(kernels, "decoder_layers", lambda x, *a: calls.append(len(x)) or kernel(x, *a))
    else:
        monkeypatch.setattr(transformer, "fused_layers", lambda *a: None)
    return calls


@pytest.mark.parametrize("fused", [True, False])
def test_a_sibling_gets_the_logits_and_kv_of_the_chain_token_it_stands_for(tmp_path, monkeypatch, fused):
    c = open_model(str(write_tiny_model(tiny_config("llama"), tmp_path / "m", seed=5))).config
    model = Transformer(c, open_model(str(tmp_path / "m")).load_tensors(), "f32", max_positions=64)
    cache = KVCache(c.num_layers, 2, 64, c.num_kv_heads, c.head_dim)
    calls = take_path(monkeypatch, fused)
    n = len(PROMPT)
    with torch.inference_mode():
        for slot in (0, 1):
            model(ForwardBatch.build([Row(slot, 0, PROMPT)]), cache)
        # Slot 0 verifies the chain 40, 41, 42 after its last token 39, with 50 a sibling of 41;
        # slot 1 verifies the chain 40, 50 that the sibling stands for.
        tree = model.logits(model(ForwardBatch.build([Row(0, n, [39, 40, 41, 42, 50], [0, 1, 2, 3, 2])]), cache))
        chain = model.logits(model(ForwardBatch.build([Row(1, n, [39, 40, 50])]), cache))
    assert (5 in calls) == fused  # the tree row took the path under test
    torch.testing.assert_close(tree[[0, 1, 4]], chain, rtol=0, atol=1e-5)
    cache.move(0, n + 4, n + 2)  # the sibling kept: its K/V to where the chain's 41 was
    for layer in range(c.num_layers):
        torch.testing.assert_close(cache.k[layer][0, :, :n + 3], cache.k[layer][1, :, :n + 3], rtol=0, atol=1e-5)
        torch.testing.assert_close(cache.v[layer][0, :, :n + 3], cache.v[layer][1, :, :n + 3], rtol=0, atol=1e-5)


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("cache_kind", ["per-slot", "unified", "q8_0"])
@pytest.mark.parametrize("prompt", [6, 21], ids=["within the budget", "past the budget"])
def test_over_qsa_layers_a_kept_sibling_leaves_the_chains_logits_kv_and_pooled_keys(tmp_path, monkeypatch, fused,
                                                                                   cache_kind, prompt):
    # Every layer QSA, ratio 4, budget 8 (two blocks): from position 12 a query keeps 2 of its blocks.
    files = open_model(str(write_tiny_model(tiny_config("llama"), tmp_path / "m", seed=5)))
    c, _ = with_compression(files.config, CompressRatios.parse("all:4"), 8, ())
    model = Transformer(c, files.load_tensors(), "f32", max_positions=64)
    dtype = torch.int8 if cache_kind == "q8_0" else torch.float32
    layout = PagedKVCache if cache_kind == "unified" else KVCache
    cache = layout(c.num_layers, 2, 128 if cache_kind == "unified" else 64, c.num_kv_heads, c.head_dim, dtype,
                   specs=model.specs)
    calls = take_path(monkeypatch, fused)
    ids = [(5 * i) % 60 + 3 for i in range(prompt)]
    n = len(ids)
    with torch.inference_mode():
        for slot in (0, 1):
            cache.ensure(slot, n + 5)
            model(ForwardBatch.build([Row(slot, 0, ids)]), cache)
        # The sibling 50 stands beside the chain's 41, at position n + 2: past the budget there, it
        # selects its blocks as the chain token it replaces would.
        tree = model.logits(model(ForwardBatch.build([Row(0, n, [39, 40, 41, 42, 50], [0, 1, 2, 3, 2])]), cache))
        chain = model.logits(model(ForwardBatch.build([Row(1, n, [39, 40, 50])]), cache))
    assert (5 in calls) == fused
    torch.testing.assert_close(tree[[0, 1, 4]], chain, rtol=0, atol=1e-5)
    cache.move(0, n + 4, n + 2)
    blocks = (n + 3) // 4
    for layer in range(c.num_layers):
        for side in (0, 1):
            torch.testing.assert_close(cache.read(layer, 0, n + 3)[side], cache.read(layer, 1, n + 3)[side],
                                       rtol=0, atol=1e-5)
        torch.testing.assert_close(cache.read_pool(layer, 0, blocks), cache.read_pool(layer, 1, blocks),
                                   rtol=0, atol=1e-6)


def test_siblings_need_a_draft_distribution(tmp_path):
    with pytest.raises(ConfigError, match="spec_draft_width=2: must be 1 with spec_type=ngram-simple"):
        SpecConfig(type="ngram-simple", width=2)


class FixedDrafter(CachedDrafter):
    """A drafter whose every row gives the same distribution over 8 tokens: `probs`."""
    needs_hidden = False

    def __init__(self, probs: list[float], width: int):
        super().__init__(None, 8, width, p_sibling=0.1)
        self.logits = torch.tensor(probs).log()

    def catch_up_rows(self, span):
        return Row(span.request.slot, span.start, span.request.token_ids[span.start:span.end + 1]), None

    def run(self, depth, rows, hidden, at=None):
        return None, self.logits.expand(len(rows) if at is None else len(at), -1)


@pytest.mark.parametrize("probs, width, tokens, siblings", [
    # Below p_min 0.5 alone, the top-1 and its siblings of >= 0.1 hold 0.65: they are verified, and
    # the chain goes no deeper.
    ([0.40, 0.15, 0.10, 0.09, 0.09, 0.09, 0.04, 0.04], 3, [0], [(0, 1), (0, 2)]),
    # A chain drafts nothing there.
    ([0.40, 0.15, 0.10, 0.09, 0.09, 0.09, 0.04, 0.04], 1, [], []),
    # Together still below p_min: nothing.
    ([0.30, 0.12, 0.09, 0.09, 0.1, 0.1, 0.1, 0.1], 2, [], []),
    # A confident top-1 chains on to n_max, a sibling beside each depth.
    ([0.60, 0.15, 0.05, 0.05, 0.05, 0.04, 0.03, 0.03], 2, [0, 0, 0], [(0, 1), (1, 1), (2, 1)]),
])
def test_a_depth_below_p_min_is_verified_when_its_candidates_hold_p_min_together(probs, width, tokens, siblings):
    req = Request("r", [5, 6, 7], SamplingParams(temperature=0), on_output=None,
                  draft_limits=DraftLimits(n_max=3, n_min=0, p_min=0.5))
    req.token_ids.append(3)  # one output token: the request decodes
    req.admit(slot=0, reuse=3, now=0.0)
    draft = FixedDrafter(probs, width).draft([Span(req, 0, 3, None, room=16)])[req]
    assert (draft.tokens, draft.siblings) == (tokens, siblings)
