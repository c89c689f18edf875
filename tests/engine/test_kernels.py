"""tandem's own CPU kernels (engine/ops/csrc) compute what the torch reference computes, for every
weight format and the shapes the engine sends them (ragged K, a few rows, grouped heads), and the
model gives the same logits with and without them."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.cli.tiny import write_tiny_model
from engine.files.weights import open_model
from engine.model import rope, transformer
from engine.model.batch import ForwardBatch, Row
from engine.model.kv_cache import KV_DTYPES, KVCache, PagedKVCache, Q8Storage, recurrent_cache
from engine.model.layer_spec import trunk_specs as model_specs
from engine.model.transformer import Transformer
from engine.ops import arena, blocks, kernels, quant
from engine.ops.arena import move_to_huge_pages
from tests.engine.block_samples import READ_ONLY, sample_blocks, widths
from tests.engine.test_parity import tiny_config


def test_kernels_build_on_this_machine():
    # CI machines have a compiler: a silent fallback to torch's kernels would hide a broken build.
    assert kernels.available()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 16])
@pytest.mark.parametrize("k", [15, 64, 100, 576])
def test_linear_rows_matches_matmul(dtype, rows, k):
    torch.manual_seed(rows * 1000 + k)
    n = 37  # not a multiple of the kernel's 4-channel blocks
    w = (torch.randn(n, k) * 40).to(dtype)
    scale, bias = torch.rand(n), torch.randn(n)
    for x_dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)]:
        x = torch.randn(rows, k).to(x_dtype)
        ref = x.float() @ w.float().T
        y = kernels.linear_rows(x, w, scale, bias)
        assert y.dtype == x_dtype and y.shape == (rows, n)
        assert ((y.float() - (ref * scale + bias)).abs().max() / ref.abs().max()) < tol
        plain = kernels.linear_rows(x, w, None, None)
        assert ((plain.float() - ref).abs().max() / ref.abs().max()) < tol


@pytest.mark.parametrize("fmt", blocks.FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 13, 16])
@pytest.mark.parametrize("k", [32, 96, 160, 576, 2080])  # 2080: 65 blocks, past a chunk of scales
def test_block_linear_rows_matches_dequantize_then_matmul(fmt, rows, k):
    # A block weight widens in registers to the f32 numbers d * q engine.ops.blocks.dequantize gives (a
    # q4_1 block's minimum m multiplies the block's sum of x apart): the product is torch's f32 one
    # on the dequantized matrix, up to the order and grouping of the sum.
    torch.manual_seed(rows * 1000 + k)
    n = 37  # not a multiple of the kernel's 4-channel blocks
    data = blocks.quantize(torch.randn(n, k), fmt)
    w, bias, x = blocks.dequantize(data, fmt, k), torch.randn(n), torch.randn(rows, k)
    ref = x @ w.T + bias
    y = kernels.linear_rows(x, data, None, bias)
    assert y.shape == (rows, n)
    assert ((y - ref).abs().max() / ref.abs().max()) < 1e-5


@pytest.mark.parametrize("fmt", ["f32", "bf16", "int8", *blocks.SERVED])
def test_a_row_gives_the_same_bits_whatever_rows_share_the_call(fmt):
    # Speculation's exactness rests on this: a verify row (one of several) must equal the decode
    # row the target would have run alone, bit for bit, whichever row tile the kernel picks.
    torch.manual_seed(7)
    n, k = 37, 256
    if fmt in blocks.SERVED:
        w, scale = blocks.kernel_view(sample_blocks(fmt, n, k), fmt, k), None
    else:
        w, scale = (torch.randn(n, k) * 40).to({"f32": torch.float32, "bf16": torch.bfloat16, "int8": torch.int8}[fmt]), \
            torch.rand(n)
    x = torch.randn(17, k)
    alone = torch.cat([kernels.linear_rows(x[i:i + 1], w, scale, None) for i in range(17)])
    for rows in (2, 4, 5, 8, 9, 12, 16, 17):
        assert torch.equal(kernels.linear_rows(x[:rows], w, scale, None), alone[:rows]), rows


def q8_reading(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] as 8-bit activations stand for it: per block of 32, d = max|x| / 127 (kept as f16) and
    q = round(x / d) half to even, read back as d * q (llama.cpp's q8_0 of an activation row)."""
    b = x.view(x.shape[0], -1, blocks.BLOCK)
    d = b.abs().amax(-1, keepdim=True) / 127
    q = torch.round(b * torch.where(d == 0, torch.zeros_like(d), 1 / d))
    return (q * d.half().float()).view_as(x)


@pytest.mark.parametrize("fmt", blocks.FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9, 40])
@pytest.mark.parametrize("k", [32, 96, 160, 576, 2080])  # groups of 4 blocks with 1, 3 and 1 left over
def test_block_weights_against_8_bit_activations_give_the_integer_product(fmt, rows, k):
    # With q8 activations a block's product is sum u q exact in int32, times d_w d_x, less its offset's
    # share: the f32 product of the dequantized weight with the quantized-then-read-back x, up to the
    # order of the f32 sum over blocks.
    torch.manual_seed(rows * 1000 + k)
    n = 37
    data = blocks.quantize(torch.randn(n, k), fmt)
    bias, x = torch.randn(n), torch.randn(rows, k)
    if k > 32:
        x[0, :32] = 0  # a zero block: d = 0, no division by it
    if not kernels.q8_activations_supported():
        with pytest.raises(RuntimeError, match="8-bit activations need AVX-512 VNNI"):
            kernels.linear_rows(x, data, None, bias, True)
        return
    ref = q8_reading(x) @ blocks.dequantize(data, fmt, k).T + bias
    y = kernels.linear_rows(x, data, None, bias, True)
    assert ((y - ref).abs().max() / ref.abs().max()) < 1e-5
    f32 = kernels.linear_rows(x, data, None, bias)
    assert not torch.equal(y, f32)  # the activations were quantized, not read as f32


@pytest.mark.skipif(not kernels.q8_activations_supported(), reason="the host lacks AVX-512 VNNI and AVX2 (the refusal "
                    "is tested above)")
@pytest.mark.parametrize("fmt", blocks.SERVED)
def test_a_row_against_8_bit_activations_gives_the_same_bits_whatever_rows_share_the_call(fmt):
    torch.manual_seed(8)
    n, k = 37, 256 if fmt in blocks.SUPER_BYTES else 160
    w = blocks.kernel_view(sample_blocks(fmt, n, k), fmt, k)
    x = torch.randn(40, k)
    alone = torch.cat([kernels.linear_rows(x[i:i + 1], w, None, None, True) for i in range(40)])
    # 16 rows and more take the prompt's tiles (6 channels x 3 rows from staged groups): 37 channels
    # leave a lone one, 17 and 40 rows a partial row tile.
    for rows in (2, 4, 5, 8, 9, 15, 16, 17, 40):
        assert torch.equal(kernels.linear_rows(x[:rows], w, None, None, True), alone[:rows]), rows


@pytest.mark.parametrize("fmt", blocks.SERVED)
def test_dequantize_blocks_gives_the_numbers_the_f32_path_reads(fmt):
    # For the formats tandem only reads, blocks.dequantize is the gguf package's: llama.cpp's numbers.
    data = sample_blocks(fmt, 45, 512)
    assert torch.equal(kernels.dequantize_blocks(blocks.kernel_view(data, fmt, 512), 512), blocks.dequantize(data, fmt, 512))


@pytest.mark.parametrize("fmt", READ_ONLY)
def test_formats_read_as_files_hold_them_give_their_dequantized_product(fmt):
    # q5_1 and the K-quants, at the row widths the families use: with f32 activations the product
    # of the weights llama.cpp dequantizes, up to summation order; with 8-bit activations the f32
    # product of those weights with x's q8_0 reading, each sub-block an exact integer dot product.
    for k in widths(fmt):
        n = 37
        data = sample_blocks(fmt, n, k, seed=k)
        w, weights = blocks.kernel_view(data, fmt, k), blocks.dequantize(data, fmt, k)
        for rows in (1, 3, 5, 9, 16):
            x, bias = torch.randn(rows, k), torch.randn(n)
            ref = x @ weights.T + bias
            y = kernels.linear_rows(x, w, None, bias)
            assert ((y - ref).abs().max() / ref.abs().max()) < 1e-5, (k, rows)
            if kernels.q8_activations_cover(fmt):
                ref = q8_reading(x) @ weights.T + bias
                y8 = kernels.linear_rows(x, w, None, bias, True)
                assert ((y8 - ref).abs().max() / ref.abs().max()) < 1e-5, (k, rows)
                assert not torch.equal(y8, y)
            elif kernels.q8_activations_supported():  # AVX2 alone: a K-quant keeps f32 activations
                assert torch.equal(kernels.linear_rows(x, w, None, bias, True), y)


def test_a_stacked_weight_gives_each_parts_own_product():
    # A fused projection of several formats: each part's outputs are the bits that part alone gives.
    parts = [blocks.BlockTensor(f, sample_blocks(f, rows, 512, seed=rows), 512)
             for f, rows in (("q4_k", 9), ("q6_k", 4), ("q5_0", 5), ("q8_0", 3))]
    stacked = blocks.cat_rows(parts)
    x, bias = torch.randn(5, 512), torch.randn(21)
    for q8 in (False, True) if kernels.q8_activations_supported() else (False,):
        y = kernels.linear_rows(x, stacked.bytes(), stacked.layout(), bias, q8)
        alone = torch.cat([kernels.linear_rows(x, blocks.kernel_view(p.data, p.format, 512), None, b, q8)
                           for p, b in zip(parts, bias.split([9, 4, 5, 3]))], dim=1)
        assert torch.equal(y, alone)
    with pytest.raises(RuntimeError, match="layout covers 6032 of its 7664 bytes"):
        kernels.linear_rows(x, stacked.bytes(), stacked.layout()[:3], None)


def test_a_k_quant_weight_of_the_wrong_shape_is_named():
    with pytest.raises(RuntimeError, match=r"B 144 \(Q4_K\), 176 \(Q5_K\) or 210 \(Q6_K\); got \[4, 2, 150\]"):
        kernels.linear_rows(torch.randn(1, 512), torch.zeros(4, 2, 150, dtype=torch.uint8), None, None)
    with pytest.raises(RuntimeError, match="for K = 256"):  # two super-blocks a row, against 256 inputs
        kernels.linear_rows(torch.randn(1, 256), torch.zeros(4, 2, 144, dtype=torch.uint8), None, None)


def test_block_linear_rows_names_rows_that_are_not_whole_blocks():
    with pytest.raises(RuntimeError, match="got rows of 20 bytes for K = 48"):
        kernels.linear_rows(torch.randn(1, 48), torch.zeros(4, 20, dtype=torch.uint8), None, None)


def test_linear_rows_names_bad_shapes():
    with pytest.raises(RuntimeError, match="weight \\[N, K\\]"):
        kernels.linear_rows(torch.randn(2, 8), torch.randn(4, 9), None, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_matches_reference_order(dtype):
    torch.manual_seed(3)  # its own numbers, whatever ran before it on this worker
    x, w = torch.randn(5, 3, 160).to(dtype), torch.randn(160).to(dtype)
    ref = w * F.rms_norm(x.float(), (160,), eps=1e-6).to(dtype)
    # An f32 ulp of the largest outputs (about 7) is 5e-7: two roundings apart at most.
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-6), ref, rtol=0, atol=2e-6 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-6), (torch.bfloat16, 3e-2)])
def test_rope_in_place_on_a_strided_view(dtype, tol):
    qkv = torch.randn(4, 7, 160).to(dtype)  # q and k heads are the first 5 of 7
    before = qkv.clone()
    angles = torch.rand(4, 80) * 6
    cos, sin = torch.cat([angles.cos()] * 2, -1).to(dtype), torch.cat([angles.sin()] * 2, -1).to(dtype)
    kernels.rope_(qkv[:, :5], cos, sin)
    ref = rope.apply_rope(before[:, :5].float(), cos[:, None].float(), sin[:, None].float())
    torch.testing.assert_close(qkv[:, :5].float(), ref, rtol=0, atol=tol)
    assert torch.equal(qkv[:, 5:], before[:, 5:])  # v untouched


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (16, 8), (4, 4)])
@pytest.mark.parametrize("d", [64, 160, 48])  # 48: a head size the f32 path is not compiled for
def test_decode_attention_matches_sdpa_row_by_row(heads, kv_heads, dtype, tol, d):
    slots, ctx = 4, 1600
    cache_k, cache_v = torch.randn(slots, kv_heads, ctx, d).to(dtype), torch.randn(slots, kv_heads, ctx, d).to(dtype)
    rows_slot, rows_len = torch.tensor([2, 0, 3, 1]), torch.tensor([1, 200, 37, 1500])
    q = torch.randn(4, heads, d).to(dtype)
    out = kernels.decode_attention(q, cache_k, cache_v, rows_slot, rows_len, d ** -0.5)
    for r, (s, n) in enumerate(zip(rows_slot.tolist(), rows_len.tolist())):
        k, v = cache_k[s, :, :n].float(), cache_v[s, :, :n].float()
        ref = F.scaled_dot_product_attention(q[r].float().view(kv_heads, heads // kv_heads, 1, d), k[:, None], v[:, None])
        torch.testing.assert_close(out[r].float(), ref.reshape(heads, d), rtol=0, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, first", [(4, 150), (4, 509), (10, 1500)])  # one span, across two, past a block
def test_a_verify_row_attends_with_the_same_bits_as_the_decode_row_it_stands_for(dtype, rows, first):
    # The rows of a verify block share their keys' reads, and a long row's keys split into spans
    # whose results merge; neither may change a row's bits.
    torch.manual_seed(3)
    cache_k, cache_v = torch.randn(2, 3, 1600, 64).to(dtype), torch.randn(2, 3, 1600, 64).to(dtype)
    q = torch.randn(rows + 1, 9, 64).to(dtype)
    slots, lengths = torch.tensor([1] * rows + [0]), torch.tensor([*range(first, first + rows), 17])
    together = kernels.decode_attention(q, cache_k, cache_v, slots, lengths, 0.125)
    for r in range(rows + 1):
        alone = kernels.decode_attention(q[r:r + 1], cache_k, cache_v, slots[r:r + 1], lengths[r:r + 1], 0.125)
        assert torch.equal(together[r], alone[0]), r
    k, v = cache_k[1, :, :first + rows - 1].float(), cache_v[1, :, :first + rows - 1].float()
    ref = F.scaled_dot_product_attention(q[rows - 1].float().view(3, 3, 1, 64), k[:, None], v[:, None], scale=0.125)
    torch.testing.assert_close(together[rows - 1].float(), ref.reshape(9, 64), rtol=0,
                               atol=1e-5 if dtype == torch.float32 else 2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("length", [1, 16, 17, 40])  # its own key alone, ending a block of 16, past one
def test_a_tree_node_attends_with_the_bits_of_the_chain_node_it_stands_for(dtype, length):
    # A sibling's K/V lies at a scratch position past the chain's; with `last` naming it, it attends
    # the prefix and itself exactly as it would from the chain's position length-1.
    torch.manual_seed(4)
    k, v = torch.randn(2, 3, 64, 64).to(dtype), torch.randn(2, 3, 64, 64).to(dtype)
    q = torch.randn(1, 9, 64).to(dtype)
    chain = kernels.decode_attention(q, k, v, torch.tensor([1]), torch.tensor([length]), 0.125)
    scratch = length + 6
    k[1, :, scratch], v[1, :, scratch] = k[1, :, length - 1], v[1, :, length - 1]
    k[1, :, length - 1], v[1, :, length - 1] = torch.randn(3, 64), torch.randn(3, 64)  # another node's
    tree = kernels.decode_attention(q, k, v, torch.tensor([1]), torch.tensor([length]), 0.125, torch.tensor([scratch]))
    assert torch.equal(tree, chain)


@pytest.mark.parametrize("dtype, d", [(torch.float32, 64), (torch.bfloat16, 64), (torch.float32, 48)])
def test_a_pool_read_through_its_page_table_attends_as_the_slot_major_cache_it_stands_for(dtype, d):
    # Slot 1 holds pages 5, 0, 3 of a pool of 8 pages of 16: its positions 0-15, 16-31 and 32-47.
    # Read through the table it attends with the same bits as the slot-major copy of its keys,
    # decode rows, verify rows and a tree node (`last`) alike.
    torch.manual_seed(6)
    page, pages = 16, torch.tensor([[1, 2, 4, 0, 0, 0, 0, 0], [5, 0, 3, 0, 0, 0, 0, 0]])  # a row per slot, a column per page
    pool_k, pool_v = torch.randn(1, 3, 8 * page, d).to(dtype), torch.randn(1, 3, 8 * page, d).to(dtype)
    rows = (pages[:, :3, None] * page + torch.arange(page)).flatten(1)  # [slot, position] -> pool row
    slot_k, slot_v = pool_k[0][:, rows].transpose(0, 1), pool_v[0][:, rows].transpose(0, 1)  # [2, 3, 48, d]
    q = torch.randn(5, 9, d).to(dtype)
    slots, lengths, last = torch.tensor([1, 1, 1, 0, 1]), torch.tensor([1, 17, 40, 33, 30]), torch.tensor([0, 16, 39, 32, 45])
    paged = kernels.decode_attention(q, pool_k, pool_v, slots, lengths, 0.125, last, pages)
    assert torch.equal(paged, kernels.decode_attention(q, slot_k.contiguous(), slot_v.contiguous(), slots, lengths,
                                                       0.125, last))


def test_a_long_verify_block_read_through_a_page_table_attends_as_the_slot_major_cache():
    # 48 pages of 16 in a shuffled order; a verify block of 4 rows past the first span of keys.
    torch.manual_seed(7)
    page, order = 16, torch.randperm(48)
    pool_k, pool_v = torch.randn(1, 3, 48 * page, 64), torch.randn(1, 3, 48 * page, 64)
    rows = (order[:, None] * page + torch.arange(page)).flatten()
    slot_k, slot_v = pool_k[0][:, rows][None].contiguous(), pool_v[0][:, rows][None].contiguous()  # [1, 3, 768, 64]
    q, slots, lengths = torch.randn(4, 9, 64), torch.zeros(4, dtype=torch.long), torch.arange(700, 704)
    paged = kernels.decode_attention(q, pool_k, pool_v, slots, lengths, 0.125, pages=order[None].clone())
    assert torch.equal(paged, kernels.decode_attention(q, slot_k, slot_v, slots, lengths, 0.125))


@pytest.mark.parametrize("d", [64, 80, 16])  # blocks of 32; 80 and 16: one block a row
def test_the_kernels_write_q8_0_as_the_cache_does(d):
    x = torch.randn(40, 3, d) * torch.logspace(-3, 2, 40)[:, None, None]
    x[0, 1] = 0  # a zero block keeps a zero scale
    store = Q8Storage((40, 3, d))
    store[:] = x
    values, scales = kernels.quantize_q8(x)
    assert torch.equal(values, store.q) and torch.equal(scales, store.scale)


@pytest.mark.parametrize("d", [64, 160, 48])  # 48: a head size without the fast path (read as f32 copies)
def test_a_q8_0_cache_attends_as_its_f32_reading_read_as_stored(d):
    # Decode rows, a verify block across two spans and a tree node (`last`), slot-major and paged:
    # the q8_0 layer read in place gives what its dequantized f32 copy gives, and a verify row the
    # bits of the decode row it stands for.
    torch.manual_seed(8)
    k, v = Q8Storage((2, 3, 1024, d)), Q8Storage((2, 3, 1024, d))
    k[:], v[:] = torch.randn(2, 3, 1024, d), torch.randn(2, 3, 1024, d)
    q = torch.randn(7, 9, d)
    slots, lengths = torch.tensor([0, 1, 1, 1, 1, 0, 1]), torch.tensor([1, 509, 510, 511, 512, 300, 40])
    last = torch.tensor([0, 508, 509, 510, 511, 299, 700])  # the last row: a node at scratch position 700
    scales = dict(k_scale=k.scale, v_scale=v.scale)
    out = kernels.decode_attention(q, k.q, v.q, slots, lengths, d ** -0.5, last, **scales)
    floats = kernels.decode_attention(q, k[:].contiguous(), v[:].contiguous(), slots, lengths, d ** -0.5, last)
    torch.testing.assert_close(out, floats, rtol=0, atol=1e-5)
    for r in range(len(q)):
        alone = kernels.decode_attention(q[r:r + 1], k.q, v.q, slots[r:r + 1], lengths[r:r + 1], d ** -0.5,
                                         last[r:r + 1], **scales)
        assert torch.equal(out[r], alone[0]), r
    page, order = 16, torch.randperm(128).view(2, 64)  # the two slots' 64 pages each, shuffled through one pool
    pages = torch.cat([order, torch.zeros(2, 64, dtype=torch.long)], 1)  # a column per page of the pool
    pool_k, pool_v = Q8Storage((1, 3, 128 * page, d)), Q8Storage((1, 3, 128 * page, d))
    for pool, store in ((pool_k, k), (pool_v, v)):
        rows = (order[:, :, None] * page + torch.arange(page)).flatten(1)  # [slot, position] -> pool row
        for slot in range(2):
            pool.q[0][:, rows[slot]], pool.scale[0][:, rows[slot]] = store.q[slot], store.scale[slot]
    paged = kernels.decode_attention(q, pool_k.q, pool_v.q, slots, lengths, d ** -0.5, last, pages,
                                     pool_k.scale, pool_v.scale)
    assert torch.equal(paged, out)


def test_decode_attention_names_a_q8_0_layer_of_the_wrong_shape():
    values = torch.zeros(1, 1, 8, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match=r"f16 scales \[\.\.\., 2\]"):
        kernels.decode_attention(torch.zeros(1, 1, 64), values, values, torch.tensor([0]), torch.tensor([3]), 0.5,
                                 k_scale=torch.zeros(1, 1, 8, 1, dtype=torch.half),
                                 v_scale=torch.zeros(1, 1, 8, 1, dtype=torch.half))


def test_decode_attention_names_a_page_outside_the_pool():
    pool = torch.zeros(1, 1, 64, 4)  # 4 pages of 16
    with pytest.raises(RuntimeError, match="slot 0's page 1 is 9, outside a pool of 4 pages"):
        kernels.decode_attention(torch.zeros(1, 1, 4), pool, pool, torch.tensor([0]), torch.tensor([20]), 0.5,
                                 pages=torch.tensor([[2, 9, 0, 0]]))


def test_decode_attention_refuses_a_row_outside_the_cache():
    cache = torch.zeros(2, 1, 8, 4)
    with pytest.raises(RuntimeError, match="row 0 reads slot 2 length 3"):
        kernels.decode_attention(torch.zeros(1, 1, 4), cache, cache, torch.tensor([2]), torch.tensor([3]), 0.5)


def test_huge_page_block_keeps_every_weight():
    layers = torch.nn.ModuleList(quant.Linear(torch.randn(1024, 576), None, "int8") for _ in range(5))
    before = [layer.weight.clone() for layer in layers]
    move_to_huge_pages(layers)
    addresses = [layer.weight.data_ptr() for layer in layers]
    assert all(b - a == 1024 * 576 for a, b in zip(addresses, addresses[1:]))  # one block, in order
    assert all(torch.equal(layer.weight, w) for layer, w in zip(layers, before))
    x = torch.randn(2, 576)
    with torch.inference_mode():  # the kernels serve inference; autograd takes torch's ops
        assert torch.equal(layers[0](x), kernels.linear_rows(x, before[0], layers[0].scale, None))


def test_a_cache_of_a_huge_page_or_more_lies_on_its_own_huge_page_aligned_zeros():
    big, small = arena.zeros((2, 1024, 256)), arena.zeros((4, 8), torch.int8)
    assert big.shape == (2, 1024, 256) and big.dtype == torch.float32 and not big.any()
    assert big.data_ptr() % arena.HUGE_PAGE == 0  # its own block, from a huge page's start
    assert small.dtype == torch.int8 and not small.any()  # too small to take a huge page: torch's memory
    big[1, 3, 5] = 2.0  # writable, and one tensor
    assert big.sum() == 2.0


@pytest.mark.parametrize("dtype", ["f32", "int8", "q4_1"])
def test_model_gives_the_same_logits_without_the_kernels(tmp_path, monkeypatch, dtype):
    path = write_tiny_model(tiny_config("qwen3"), tmp_path / "m", seed=3)
    files = open_model(str(path))
    c = files.config
    tokens = list(range(3, 23))

    @torch.inference_mode()
    def logits() -> torch.Tensor:
        model = Transformer(c, files.load_tensors(), dtype, max_positions=64)
        cache = KVCache(c.num_layers, 1, 64, c.num_kv_heads, c.head_dim)
        out = [model.logits(model(ForwardBatch.build([Row(0, 0, tokens[:16])]), cache))]
        for i, t in enumerate(tokens[16:]):  # single-token decode: the matrix-vector and attention kernels
            out.append(model.logits(model(ForwardBatch.build([Row(0, 16 + i, [t])]), cache)))
        return torch.cat(out)

    with_kernels = logits()
    monkeypatch.setattr(kernels, "available", lambda: False)
    torch.testing.assert_close(with_kernels, logits(), rtol=0, atol=1e-4)


LAYER_CASES = [(family, dtype, False, None) for family in ["llama", "qwen2", "qwen3", "hd160"]
               for dtype in ["f32", "bf16", "int8", "q4_0", "q4_1", "q8_0"]]
# The unified pool (the main command's cache) with slots' pages interleaved.
LAYER_CASES += [("llama", "f32", True, None), ("qwen3", "q4_1", True, None), ("hd160", "int8", True, None),
                ("qwen2", "bf16", True, None)]
# A q8_0 cache (-ctk/-ctv q8_0), slot-major and unified; hd160's heads hold 5 blocks of 32.
LAYER_CASES += [("llama", "f32", False, "q8_0"), ("hd160", "int8", False, "q8_0"), ("qwen3", "q4_1", True, "q8_0")]
# Qwen3.5: gated attention with partial RoPE beside Gated DeltaNet layers and their states.
LAYER_CASES += [("qwen3_5", "f32", False, None), ("qwen3_5", "q8_0", True, None), ("qwen3_5", "q4_0", False, None)]


@pytest.mark.parametrize("family, dtype, paged, cache_type", LAYER_CASES)
def test_whole_layer_kernel_equals_the_layer_by_layer_path(tmp_path, monkeypatch, family, dtype, paged, cache_type):
    # A step of three slots: a 3-token verify block, a plain decode token, a 2-token prompt chunk,
    # after prompts of different lengths. Each of its tokens attends causally within its own slot.
    # A q8_0 cache is written by the kernel as Q8Storage writes it and read as stored.
    path = write_tiny_model(tiny_config(family), tmp_path / "m", seed=5)
    files = open_model(str(path))
    c = files.config
    prompts = [list(range(3, 30)), list(range(20, 25)), list(range(30, 38))]
    step_rows = [Row(0, 27, [40, 41, 42]), Row(1, 5, [43]), Row(2, 8, [44, 45])]

    @torch.inference_mode()
    def run(dtype: str) -> tuple[torch.Tensor, KVCache]:
        model = Transformer(c, files.load_tensors(), dtype, max_positions=64)
        layout = PagedKVCache if paged else KVCache
        cache = layout(c.num_layers, 3, 3 * 64 if paged else 64, c.num_kv_heads, c.head_dim,
                       dtype=KV_DTYPES[cache_type] if cache_type else quant.compute_dtype(dtype), specs=model.specs)
        if c.linear is not None:  # states of the verify block's every position
            cache.recurrent = recurrent_cache(c, model.specs, ["cpu"] * c.num_layers, 3, steps=4)
        for length in (16, 64):  # slot 0's second page comes after the others' first
            for slot, prompt in enumerate(prompts):
                assert cache.ensure(slot, min(length, len(prompt) + 3))
        for slot, prompt in enumerate(prompts):
            model(ForwardBatch.build([Row(slot, 0, prompt)]), cache)
        return model.logits(model(ForwardBatch.build(step_rows), cache)), cache

    calls = []
    fused = kernels.decoder_layers
    monkeypatch.setattr(kernels, "decoder_layers", lambda x, *a: calls.append(len(x)) or fused(x, *a))
    with_kernel, cache = run(dtype)
    assert 6 in calls  # the step itself went through the whole-layer kernel
    assert not paged or cache.pool.pages[0] == [0, 3]
    reference = run("f32")[0] if dtype == "bf16" else None
    monkeypatch.setattr(transformer, "fused_layers", lambda *a: None)
    layer_by_layer, reference_cache = run(dtype)
    if dtype == "bf16":
        # The verify and prompt rows' attention sums in another order (f32 in the kernel, bf16 in
        # SDPA), so the two bf16 results differ by rounding; the kernel's is as close to f32.
        error = (with_kernel - reference).abs().max()
        assert error <= 1.5 * (layer_by_layer - reference).abs().max()
        return
    # A q8_0 cache rounds each key to a step of its block's scale: where the kernel's key differs
    # from the module's in its last f32 bit, one int8 value may round the other way.
    step = 0.0 if not cache_type else max(store.scale.float().max().item() for store in cache.k + cache.v
                                          if store is not None)
    torch.testing.assert_close(with_kernel, layer_by_layer, rtol=0, atol=1e-3 if cache_type else 1e-4)
    if c.linear is not None:  # the same states after every position the step wrote
        for ours, theirs in zip(cache.recurrent.state + cache.recurrent.conv,
                                reference_cache.recurrent.state + reference_cache.recurrent.conv):
            for row in step_rows:
                for position in range(row.start, row.start + len(row.tokens)):
                    entry = position % cache.recurrent.steps
                    torch.testing.assert_close(ours[row.slot, entry], theirs[row.slot, entry], rtol=1e-4, atol=1e-5)
    for layer in [i for i, spec in enumerate(model_specs(c)) if not spec.is_recurrent]:
        for slot, row in enumerate(step_rows):  # and it wrote the same keys and values where the step wrote
            end = row.start + len(row.tokens)
            for written, reference in zip(cache.read(layer, slot, end), reference_cache.read(layer, slot, end)):
                torch.testing.assert_close(written, reference, rtol=0, atol=1e-4 + 1.01 * step)
    if cache_type:  # as stored: the same int8 values and f16 scales but for a rare rounding
        attention = [(a, b) for a, b in zip(cache.k + cache.v, reference_cache.k + reference_cache.v) if a is not None]
        for store, reference in attention:
            moved = (store.q.int() - reference.q.int()).abs()
            assert moved.max() <= 1 and (moved > 0).float().mean() < 0.001
            torch.testing.assert_close(store.scale, reference.scale, rtol=1e-3, atol=0)  # an f16 ulp
            assert (store.scale != reference.scale).float().mean() < 0.01


def tiny_llama(tmp_path, ctx: int) -> tuple[Transformer, KVCache]:
    """An f32 tiny llama and a one-slot cache of ctx positions."""
    c = open_model(str(write_tiny_model(tiny_config("llama"), tmp_path / "m", seed=5))).config
    model = Transformer(c, open_model(str(tmp_path / "m")).load_tensors(), "f32", max_positions=16)
    return model, KVCache(c.num_layers, 1, ctx, c.num_kv_heads, c.head_dim)


def test_whole_layer_kernel_leaves_hand_built_masks_to_the_layer_by_layer_path(tmp_path):
    # Draft training (train/) builds batches with masks of its own: those must not run as causal rows.
    model, cache = tiny_llama(tmp_path, 16)
    built = ForwardBatch.build([Row(0, 0, [3, 4, 5])])
    by_hand = ForwardBatch(built.rows, built.token_ids, built.positions, [torch.ones(3, 3, dtype=torch.bool)])
    x = torch.randn(3, model.config.hidden_size)
    cos, sin = model.cos[built.positions], model.sin[built.positions]
    with torch.inference_mode():
        assert transformer.fused_layers(model.layers, x, built, cos, sin, cache) is not None
        assert transformer.fused_layers(model.layers, x, by_hand, cos, sin, cache) is None


def test_a_layer_with_a_hook_runs_module_by_module(tmp_path):
    # Draft training (train/draft.py) measures the residual stream with a pre-hook on the last layer.
    model, cache = tiny_llama(tmp_path, 16)
    seen = []
    model.layers[-1].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape))
    with torch.inference_mode():
        model(ForwardBatch.build([Row(0, 0, [3, 4, 5])]), cache)
    assert seen == [torch.Size([3, model.config.hidden_size])]


def test_whole_layer_kernel_refuses_a_row_outside_the_cache(tmp_path):
    model, cache = tiny_llama(tmp_path, 8)
    batch = ForwardBatch.build([Row(0, 8, [3])])  # position 8 of an 8-position slot
    with torch.inference_mode(), pytest.raises(RuntimeError, match="row 0 writes slot 0 position 8 outside"):
        model(batch, cache)


def test_training_takes_torchs_ops_and_gets_gradients():
    layer = quant.Linear(torch.randn(8, 16), None, "f32")
    norm_weight = torch.ones(16, requires_grad=True)
    x = torch.randn(2, 16, requires_grad=True)
    y = layer(x) * 2  # 2 rows: the kernel's size, yet grad mode must route around it
    y.sum().backward()
    assert x.grad is not None and torch.count_nonzero(x.grad) > 0
    cos, sin = torch.ones(2, 16), torch.zeros(2, 16)
    out = rope.rotate(x.view(2, 1, 16) * norm_weight, cos, sin)
    out.sum().backward()
    assert norm_weight.grad is not None


def test_kernels_serve_plain_inference_only():
    with torch.inference_mode():
        assert kernels.usable()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # mixed dtypes: torch's ops follow autocast
            assert not kernels.usable()
    assert not kernels.usable()  # gradients wanted


@pytest.mark.parametrize("steps", [1, 4])  # 1: the state updated in place; 4: a verify block's every position kept
def test_gated_delta_rows_match_the_rule_token_by_token(steps):
    from engine.files import qwen3_5_layout
    from engine.files.config_readers import from_hf_dict
    from engine.model.gated_delta import GatedDeltaNet
    from engine.model.recurrent_cache import RecurrentCache
    c = from_hf_dict(tiny_config("qwen3_5", linear_key_head_dim=32, linear_value_head_dim=48))
    g = torch.Generator().manual_seed(0)
    shapes = qwen3_5_layout.block_shapes(c, "", recurrent=True)
    t = {n: torch.randn(s, generator=g) * (0.5 if n.endswith("conv1d.weight") else 0.2) for n, s in shapes.items()}
    layer = GatedDeltaNet(c, t, "linear_attn.", "f32")
    x = torch.randn(9, c.hidden_size, generator=g)
    # Slot 1 from position 0; slot 0 resumes at 5 with a block of 4; slot 2 decodes one token at 7.
    rows = [Row(1, 0, [0] * (steps if steps > 1 else 1)), Row(0, 5, [0] * steps), Row(2, 7, [0])]
    x = x[:sum(len(r.tokens) for r in rows)]
    caches = [RecurrentCache([0], 3, c.linear, steps, c.hidden_size) for _ in range(2)]
    for cache in caches:  # the same earlier states to resume from
        g.manual_seed(1)
        for store in (cache.conv[0], cache.state[0]):
            store.copy_(torch.randn(store.shape, generator=g))
    batch = ForwardBatch.build(rows)
    with torch.inference_mode():
        fast = layer(x, batch, caches[0], 0)
        hand_built = ForwardBatch(batch.rows, batch.token_ids, batch.positions, batch.masks)  # no slots: no kernel
        slow = layer(x, hand_built, caches[1], 0)
    torch.testing.assert_close(fast, slow, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(caches[0].state[0], caches[1].state[0], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(caches[0].conv[0], caches[1].conv[0])
