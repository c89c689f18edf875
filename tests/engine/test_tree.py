"""Tree verify rows (engine/batch.py, docs/architecture.md "Trees"): a sibling written at a scratch
position past the chain attends as the chain node it stands for, on the whole-layer kernel and the
layer-by-layer path alike, and once kept, its K/V moves down to the position it was verified for."""
from __future__ import annotations

import pytest
import torch

from engine import kernels
from engine import model as model_module
from engine.batch import ForwardBatch, Row, tree_mask
from engine.drafter import SpecConfig
from engine.engine import EngineConfig
from engine.errors import ConfigError
from engine.kv_cache import KVCache
from engine.model import Transformer
from engine.options import CompressRatios
from engine.preflight import read_headers
from engine.tiny import write_tiny_model
from engine.weights import open_model
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


@pytest.mark.parametrize("fused", [True, False])
def test_a_sibling_gets_the_logits_and_kv_of_the_chain_token_it_stands_for(tmp_path, monkeypatch, fused):
    c = open_model(str(write_tiny_model(tiny_config("llama"), tmp_path / "m", seed=5))).config
    model = Transformer(c, open_model(str(tmp_path / "m")).load_tensors(), "f32", max_positions=64)
    cache = KVCache(c.num_layers, 2, 64, c.num_kv_heads, c.head_dim)
    calls = []
    if fused:
        kernel = kernels.decoder_layers
        monkeypatch.setattr(kernels, "decoder_layers", lambda x, *a: calls.append(len(x)) or kernel(x, *a))
    else:
        monkeypatch.setattr(model_module, "fused_layers", lambda *a: None)
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


def test_siblings_need_a_draft_distribution_and_a_dense_target(tmp_path):
    with pytest.raises(ConfigError, match="spec_draft_width=2: must be 1 with spec_type=ngram-simple"):
        SpecConfig(type="ngram-simple", width=2)
    path = write_tiny_model(tiny_config("llama"), tmp_path / "m", seed=5)
    spec = SpecConfig(type="draft-simple", draft_model=str(path), width=2)
    with pytest.raises(ConfigError, match=r"spec_draft_width=2: must be 1 over a target with QSA layers \(ratio 4\)"):
        read_headers(EngineConfig(model=str(path), spec=spec, compress_ratios=CompressRatios.parse("all:4"),
                                  qsa_budget=16))
