"""QSA layers (docs/architecture.md, "The hybrid cache and QSA") on a model without an indexer:
exactly dense attention while a query's complete blocks fit the budget; beyond it, what a slow
reference written from the definition gives (at a block's end the query's own token competes in
its block); pooled keys that follow every rewrite; each layer's spec its own, so a dense layer owns
no pool."""
from __future__ import annotations

import math
import os

import pytest
import torch

from engine.cli.tiny import tiny_config, write_tiny_model
from engine.files.model_config import with_compression
from engine.files.weights import open_model
from engine.model import qsa
from engine.model.batch import ForwardBatch, Row
from engine.model.kv_cache import KVCache, PagedKVCache
from engine.model.layer_spec import LayerSpec
from engine.model.rope import rotate
from engine.model.transformer import Transformer, fused_layers
from engine.ops import kernels
from engine.settings import CompressRatios


def tiny(tmp_path_factory, name: str, **overrides):
    config = tiny_config(name, **overrides)
    files = open_model(write_tiny_model(config, tmp_path_factory.mktemp(name), seed=0))
    return files.config, files.load_tensors()


@pytest.fixture(scope="module")
def llama8(tmp_path_factory):
    """Eight layers, four query heads on two kv heads."""
    return tiny(tmp_path_factory, "llama", num_hidden_layers=8)


def model_with(config, tensors, ratios: str, budget: int) -> Transformer:
    qsa_config, _ = with_compression(config, CompressRatios.parse(ratios), budget)
    return Transformer(qsa_config, tensors, "f32", max_positions=256)


def cache_for(model: Transformer, slots: int = 1, ctx: int = 256, dtype=torch.float32, paged=False):
    c = model.config
    if paged:
        return PagedKVCache(c.num_layers, slots, slots * ctx, c.num_kv_heads, c.head_dim, dtype, specs=model.specs)
    return KVCache(c.num_layers, slots, ctx, c.num_kv_heads, c.head_dim, dtype, specs=model.specs)


def run(model: Transformer, cache, rows: list[Row]) -> torch.Tensor:
    return model.logits(model(ForwardBatch.build(rows), cache))


# Prompt chunks that end mid-block, single decode rows, and a verify row of four.
STEPS = [7, 9, 13, 1, 1, 4, 1, 5, 1]


def steps_of(tokens: list[int]):
    start = 0
    for n in STEPS:
        yield start, tokens[start:start + n]
        start += n


@pytest.mark.parametrize("ratio", [2, 4])
def test_qsa_equals_dense_under_budget(llama8, ratio):
    config, tensors = llama8
    dense, sparse = Transformer(config, tensors, "f32", max_positions=256), model_with(config, tensors, f"all:{ratio}", 64)
    tokens = torch.randint(0, config.vocab_size, (sum(STEPS),), generator=torch.Generator().manual_seed(0)).tolist()
    dense_cache, sparse_cache = cache_for(dense), cache_for(sparse)
    for start, chunk in steps_of(tokens):
        expected = run(dense, dense_cache, [Row(0, start, chunk)])
        torch.testing.assert_close(run(sparse, sparse_cache, [Row(0, start, chunk)]), expected, atol=1e-5, rtol=1e-5)


def reference_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, positions: list[int],
                        spec: LayerSpec) -> torch.Tensor:
    """The definition, one query and one head at a time: q [T, H, d], keys/values [kv_heads, L, d]."""
    t, heads, d = q.shape
    group = heads // keys.shape[0]
    r, out = spec.ratio, torch.zeros_like(q)
    for i, p in enumerate(positions):
        complete = (p + 1) // r
        pool = [keys[:, b * r:(b + 1) * r].mean(1) for b in range(complete)]
        if complete <= spec.keep:
            seen = list(range(p + 1))
        else:
            scores = [sum(max(0.0, float(q[i, h] @ pool[b][h // group])) for h in range(heads)) / math.sqrt(d)
                      for b in range(complete)]
            kept = torch.tensor(scores).topk(spec.keep).indices.tolist()
            seen = [pos for b in sorted(kept) for pos in range(b * r, (b + 1) * r)] + list(range(complete * r, p + 1))
        for h in range(heads):
            k, v = keys[h // group, seen], values[h // group, seen]
            out[i, h] = torch.softmax(k @ q[i, h] / math.sqrt(d), dim=0) @ v
    return out


def check_against_reference(model: Transformer, cache, rows_per_step):
    """Each QSA layer's attention output, step by step, against reference_attention over the cache's keys."""
    checked = []

    def hook(attn, args, output):
        x, batch, cos, sin, cache, layer = args
        n, heads, kv_heads, d = x.shape[0], attn.heads, attn.kv_heads, attn.head_dim
        q = rotate(attn.qkv_proj(x).view(n, heads + 2 * kv_heads, d)[:, :heads + kv_heads], cos, sin)[:, :heads]
        expected = torch.zeros(n, heads, d)
        offset = 0
        for row in batch.rows:
            t = len(row.tokens)
            keys, values = cache.read(layer, row.slot, row.start + t)
            positions = list(range(row.start, row.start + t))
            expected[offset:offset + t] = reference_attention(q[offset:offset + t], keys.float(), values.float(),
                                                              positions, attn.spec)
            offset += t
        torch.testing.assert_close(output, attn.o_proj(expected.view(n, heads * d)), atol=1e-5, rtol=1e-4)
        checked.append(layer)

    qsa_layers = [layer for layer in model.layers if layer.self_attn.spec.is_qsa]
    handles = [layer.self_attn.register_forward_hook(hook) for layer in qsa_layers]
    # The whole-layer kernel never calls the attention module: a hook on the layer keeps the step
    # module by module, where the hook above sees it (the kernel is checked against this path below).
    handles += [layer.register_forward_pre_hook(lambda module, args: None) for layer in qsa_layers]
    try:
        for rows in rows_per_step:
            model(ForwardBatch.build(rows), cache)
    finally:
        for handle in handles:
            handle.remove()
    return checked


def test_qsa_above_budget_equals_the_definition(llama8):
    config, tensors = llama8
    model = model_with(config, tensors, "every4:4", 8)  # two blocks kept: most queries are past the budget
    tokens = torch.randint(0, config.vocab_size, (sum(STEPS) + 20,), generator=torch.Generator().manual_seed(1))
    steps = [[Row(0, start, chunk)] for start, chunk in steps_of(tokens.tolist())]
    assert check_against_reference(model, cache_for(model), steps) == [3, 7] * len(steps)


def test_qsa_above_budget_equals_the_definition_with_head_dim_160(tmp_path_factory):
    config, tensors = tiny(tmp_path_factory, "hd160")
    model = model_with(config, tensors, "all:4", 8)
    tokens = list(range(1, 60))
    steps = [[Row(0, 0, tokens[:30])], [Row(0, 30, tokens[30:31])], [Row(0, 31, tokens[31:35])]]
    assert len(check_against_reference(model, cache_for(model), steps)) == 2 * len(steps)


@pytest.mark.parametrize("position", [63, 64, 66, 67])  # a block's end, its start, inside it
def test_a_lone_querys_positions_are_its_row_of_the_selection_mask(position):
    # A decode row takes its positions from its scores (qsa.attended) instead of a mask over the
    # context: the same keys in the same order, ties included (relu makes exact zeros).
    ratio, keep = 4, 5
    n = (position + 1) // ratio
    scores = torch.randn(1, n, generator=torch.Generator().manual_seed(position)).relu()
    expected = qsa.allowed(scores, torch.tensor([position]), position + 1, ratio, keep)[0].nonzero()[:, 0]
    assert torch.equal(qsa.attended(scores, position, ratio, keep), expected)


@pytest.mark.parametrize("kernel", [True, False])
@pytest.mark.parametrize("heads, kv_heads, d, n", [(8, 1, 128, 4096), (9, 3, 64, 37), (4, 2, 80, 1), (4, 2, 48, 37),
                                                    (4, 2, 36, 37)])
def test_block_scores_are_the_definition_and_a_querys_own_whatever_rows_share_the_call(heads, kv_heads, d, n, kernel,
                                                                                        monkeypatch):
    # The scores: sum over heads of relu(q . block) / sqrt(d), as the einsum of the definition to
    # rounding; and a query's scores the same bits alone (a decode row) as beside others (a verify
    # block, a prompt chunk), so both select the same blocks. Through the kernel (AVX-512 at head
    # dims 64, 80, 128, AVX2 at multiples of 8; head dim 36, and 48 with AVX-512: its portable path)
    # and through torch's ops (kernels unusable: no compiler, another device).
    if not kernel:
        monkeypatch.setattr(qsa.kernels, "usable", lambda x=None: False)
    g = torch.Generator().manual_seed(n)
    q, blocks = torch.randn(5, heads, d, generator=g), torch.randn(kv_heads, n, d, generator=g)
    qg = q.view(5, kv_heads, heads // kv_heads, d)
    expected = torch.einsum("tkgd,kbd->tkgb", qg, blocks).relu().sum((1, 2)) / math.sqrt(d)
    with torch.inference_mode():
        together = qsa.scores(q, blocks)
        torch.testing.assert_close(together, expected, atol=1e-5, rtol=1e-5)
        assert all(torch.equal(qsa.scores(q[i:i + 1], blocks)[0], together[i]) for i in range(5))


def test_two_slots_decoding_together_each_get_their_own_selection(llama8):
    config, tensors = llama8
    model = model_with(config, tensors, "every4:4", 8)
    g = torch.Generator().manual_seed(2)
    a, b = (torch.randint(0, config.vocab_size, (40,), generator=g).tolist() for _ in range(2))
    steps = [[Row(0, 0, a[:30]), Row(1, 0, b[:21])], [Row(0, 30, a[30:31]), Row(1, 21, b[21:22])],
             [Row(0, 31, a[31:35]), Row(1, 22, b[22:23])]]
    assert check_against_reference(model, cache_for(model, slots=2), steps)


@pytest.mark.parametrize("paged, dtype", [(False, torch.float32), (True, torch.float32), (False, torch.int8)])
def test_pooled_keys_equal_the_mean_of_each_blocks_current_keys_after_rewrites(llama8, paged, dtype):
    """A verify row writes positions that the next step overwrites (its drafts rejected)."""
    config, tensors = llama8
    model = model_with(config, tensors, "every4:4", 8)
    cache = cache_for(model, slots=2, dtype=dtype, paged=paged)
    if paged:
        assert cache.ensure(1, 64)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, config.vocab_size, (40,), generator=g).tolist()
    model(ForwardBatch.build([Row(1, 0, tokens[:30])]), cache)
    model(ForwardBatch.build([Row(1, 30, [5, 6, 7, 8, 9])]), cache)  # a verify row: 30..34
    model(ForwardBatch.build([Row(1, 31, [11, 12])]), cache)  # one draft kept, the rest rewritten
    for layer in (3, 7):
        keys, _ = cache.read(layer, 1, 33)
        blocks = 33 // 4
        expected = keys.float()[:, :blocks * 4].unflatten(1, (blocks, 4)).mean(2)
        torch.testing.assert_close(cache.read_pool(layer, 1, blocks), expected, atol=1e-6, rtol=1e-6)


def test_only_qsa_layers_own_a_pool_and_a_dense_draft_layer_beside_them_owns_none(llama8, tmp_path):
    from engine.model import mtp
    from engine.settings import SpecConfig
    from engine.spec.loading import check_draft_files, load_drafter
    from tests.engine.test_mtp import save_draft
    config, tensors = llama8
    model = model_with(config, tensors, "every4:4", 8)
    assert [layer.self_attn.spec.kind for layer in model.layers] == ["dense"] * 3 + ["qsa"] + ["dense"] * 3 + ["qsa"]
    cache = cache_for(model)
    assert [i for i, pool in enumerate(cache.kpool) if pool is not None] == [3, 7]
    fingerprint = mtp.target_fingerprint(config, tensors["model.embed_tokens.weight"])
    save_draft(tmp_path / "draft.safetensors", config, tensors, fingerprint)
    spec = SpecConfig(pacing=False, type="draft-mtp", draft_model=str(tmp_path / "draft.safetensors"))
    drafter = load_drafter(spec, check_draft_files(spec, config), config, tensors, "f32", slots=2, ctx_per_slot=64,
                           target_embed=model.embed_tokens)
    assert drafter.model.layers[0].block.self_attn.spec.kind == "dense"
    assert drafter.cache.kpool == [None]


def kernel_available() -> bool:
    """Whether the whole-layer kernel serves this run: CI machines have a compiler, so a build that
    fails there must fail here too, not fall back silently; only TANDEM_NO_KERNELS turns it off."""
    assert kernels.available() or os.environ.get("TANDEM_NO_KERNELS"), "tandem kernels failed to build"
    return kernels.available()


def test_a_decode_step_of_a_model_with_qsa_layers_takes_the_whole_layer_kernel(llama8):
    config, tensors = llama8
    model = model_with(config, tensors, "every4:4", 8)
    cache = cache_for(model, slots=2)
    g = torch.Generator().manual_seed(4)
    a, b = (torch.randint(0, config.vocab_size, (30,), generator=g).tolist() for _ in range(2))
    run(model, cache, [Row(0, 0, a), Row(1, 0, b[:21])])
    batch = ForwardBatch.build([Row(0, 30, [5]), Row(1, 21, [6])])  # both past the budget
    with torch.inference_mode():
        x = model.embed_tokens(batch.token_ids)
        fused = fused_layers(list(model.layers), x, batch, model.cos[batch.positions], model.sin[batch.positions],
                             cache)
    assert (fused is not None) == kernel_available()


def with_calls_counted(monkeypatch) -> list[int]:
    """The rows of each call of the whole-layer kernel from now on."""
    calls, fused = [], kernels.decoder_layers
    monkeypatch.setattr(kernels, "decoder_layers", lambda x, *args: calls.append(len(x)) or fused(x, *args))
    return calls


@pytest.mark.parametrize("ratio, paged", [(2, False), (4, False), (4, True)])
def test_whole_layer_kernel_equals_the_module_path_with_qsa_layers(llama8, monkeypatch, ratio, paged):
    """Two slots: slot 0 past the budget from its first chunk, slot 1 crossing it while decoding;
    prompt chunks, decodes, verify rows whose later tokens see blocks their earlier ones complete,
    and drafts rejected and rewritten. Paged: the two slots' pages interleave in one pool."""
    config, tensors = llama8
    fused, layered = (model_with(config, tensors, f"every2:{ratio}", 8) for _ in range(2))
    # A hook keeps the reference module by module (fused_layers leaves hooked layers alone).
    layered.layers[0].register_forward_pre_hook(lambda module, args: None)
    fused_cache, layered_cache = cache_for(fused, slots=2, paged=paged), cache_for(layered, slots=2, paged=paged)
    g = torch.Generator().manual_seed(5)
    a, b = (torch.randint(0, config.vocab_size, (80,), generator=g).tolist() for _ in range(2))
    steps = [[Row(0, 0, a[:19]), Row(1, 0, b[:5])], [Row(0, 19, a[19:30])]]
    steps += [[Row(0, 30 + i, [a[30 + i]]), Row(1, 5 + i, [b[5 + i]])] for i in range(22)]
    steps += [[Row(0, 52, a[52:57]), Row(1, 27, [b[27]])],  # verify five drafts beside a decode
              [Row(0, 54, a[60:63]), Row(1, 28, b[28:32])],  # two kept, the rest rewritten; slot 1 verifies
              [Row(0, 57, [a[63]]), Row(1, 30, [b[32]])], [Row(1, 31, [b[33]])]]
    calls = with_calls_counted(monkeypatch)
    for rows in steps:
        for cache in (fused_cache, layered_cache):
            assert all(cache.ensure(row.slot, row.start + len(row.tokens)) for row in rows)
        torch.testing.assert_close(run(fused, fused_cache, rows), run(layered, layered_cache, rows),
                                   atol=1e-5, rtol=1e-5)
    assert calls == ([sum(len(row.tokens) for row in rows) for rows in steps] if kernel_available() else [])
    if paged:
        assert fused_cache.pool.pages == [[0, 1, 3, 5], [2, 4]]  # interleaved: read through the table
    qsa_layers = [layer.index for layer in fused.layers if layer.self_attn.spec.is_qsa]
    assert qsa_layers == [1, 3, 5, 7]
    for layer in qsa_layers:
        torch.testing.assert_close(fused_cache.kpool[layer], layered_cache.kpool[layer], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(fused_cache.k[layer], layered_cache.k[layer], atol=1e-6, rtol=1e-6)


def test_decode_steps_of_a_qsa_model_run_in_one_kernel_call_each(llama8, monkeypatch):
    """Module by module a QSA layer costs ~15 Python dispatches a step; every decode step must take
    the kernel instead (the speed itself is for bench/, not a test)."""
    config, tensors = llama8
    model = model_with(config, tensors, "all:4", 8)
    cache = cache_for(model, slots=2)
    run(model, cache, [Row(0, 0, list(range(3, 40))), Row(1, 0, list(range(50, 60)))])
    calls = with_calls_counted(monkeypatch)
    for i in range(8):
        run(model, cache, [Row(0, 37 + i, [7 + i]), Row(1, 10 + i, [9 + i])])
    assert calls == ([2] * 8 if kernel_available() else [])
