"""Qwen4-Exp: experts, hyper-connections, n-gram embeddings, and QSA through the model's own
indexer beside Gated DeltaNet layers. The paths every hybrid model's requests take (chunks, decode
past the QSA budget, rolled-back verify blocks, slots side by side, snapshots) are
tests/engine/test_qwen3_5.py's, run on this family too; here, what is its own. The tiny checkpoint
(configs/tiny/qwen4_exp.json) has every component on, every parameter randomised (the
zero-initialised convolution and norm offsets included) and a budget of 2 blocks of 4, so that most
queries select."""
from __future__ import annotations

import pytest
import torch

from engine.errors import ConfigError
from engine.model.batch import ForwardBatch, Row
from engine.files.weights import open_model
from engine.model import qsa
from engine.model.norm import GroupedRMSNorm
from engine.model.transformer import Transformer
from engine.ops import kernels
from engine.ops.quant import Linear, use_activations
from tests.engine.test_parity import (PROMPT_LEN, assert_matches, load_engine_model, new_cache, one_thread,  # noqa: F401
                                      reference)
from tests.engine.test_qwen3_5 import STEPS, run

@pytest.fixture(scope="module")
def qwen(reference):
    ref = reference("qwen4_exp")
    return ref, load_engine_model(ref.path)


def test_attention_layers_are_qsa_layers_of_the_indexer_and_only_they_get_index_storage(qwen):
    _, model = qwen
    specs = model.specs
    assert [(s.kind, s.ratio, s.budget, s.index_dim) for s in specs] == \
        [("recurrent", 0, 0, 0), ("qsa", 4, 8, 16), ("recurrent", 0, 0, 0), ("qsa", 4, 8, 16)]
    cache = new_cache(model, 2, STEPS)
    has = [(cache.ikeys[i] is not None, cache.iblocks[i] is not None, cache.kpool[i] is not None)
           for i in range(len(specs))]
    # Raw indexer keys and block keys for the indexed layers; no pooled attention keys anywhere.
    assert has == [(False, False, False), (True, True, False), (False, False, False), (True, True, False)]


def test_selection_is_sparse_and_matters(qwen, monkeypatch):
    # Past 2 complete blocks a query keeps only its 2 best: attending to every position instead
    # moves the logits far past the tolerance.
    ref, model = qwen
    monkeypatch.setattr(qsa, "allowed", lambda scores, positions, length, *rule:
                        torch.arange(length) <= positions[:, None])
    (dense,), = run(model, [[Row(0, 0, ref.tokens)]])
    assert (dense - ref.logits).abs().max() > 1e-2


def test_prompt_chunks_then_decode_past_the_budget_match(qwen):
    # Chunks of at most STEPS tokens keep every position's state (the verify path); longer ones
    # keep their last; chunks ending mid-block leave the block's key to the row that completes it.
    ref, model = qwen
    bounds = [0, 3, 7, 30, 31, 33, PROMPT_LEN]
    rows = [[Row(0, a, ref.tokens[a:b])] for a, b in zip(bounds, bounds[1:])]
    rows += [[Row(0, p, [ref.tokens[p]])] for p in range(PROMPT_LEN, len(ref.tokens))]
    out = run(model, rows)
    assert_matches(torch.cat([r[0] for r in out]), ref.logits)


def test_an_end_of_sequence_token_resets_the_n_grams_as_transformers_does(qwen):
    from transformers import AutoModelForCausalLM
    ref, model = qwen
    eos = model.config.eos_token_ids[0]
    tokens = list(ref.tokens[:30])
    tokens[9], tokens[20], tokens[21] = eos, eos, eos
    hf = AutoModelForCausalLM.from_pretrained(str(ref.path), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    out = run(model, [[Row(0, 0, tokens[:8])], [Row(0, 8, tokens[8:11])], [Row(0, 11, tokens[11:])]])
    assert_matches(torch.cat([r[0] for r in out]), expected)


def test_the_mtp_layer_takes_the_streams_before_the_mixer_as_transformers_modules_compute_it(qwen):
    # transformers has no MTP module for this model: the documented step (docs/architecture.md,
    # "Qwen4-Exp's own MTP") is built here from its decoder layer, stream mixer and norms, loaded
    # with the checkpoint's mtp.* tensors, and fed the target's last layer's streams.
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.models.qwen4_exp.modeling_qwen4_exp import (Qwen4ExpTextDecoderLayer,
                                                                  Qwen4ExpTextGatedResidual, Qwen4ExpTextRMSNorm)

    from engine.files.weights import open_model
    from engine.model.kv_cache import KVCache
    from engine.model.layer_spec import DENSE
    from engine.model.qwen4_exp_mtp import Qwen4ExpNextN
    ref, model = qwen
    hf = AutoModelForCausalLM.from_pretrained(str(ref.path), dtype=torch.float32, attn_implementation="eager").eval()
    c, tensors = hf.config, load_file(str(ref.path / "model.safetensors"))
    h, streams = c.hidden_size, c.hc_count

    def loaded(module, prefix):
        module.load_state_dict({k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})
        return module.eval()

    layer = loaded(Qwen4ExpTextDecoderLayer(c, c.layer_types.index("indexed_attention")), "mtp.layers.0.")
    mixer = loaded(Qwen4ExpTextGatedResidual(c, use_combine=False), "mtp.hyper_connection_mixer.")
    enorm, hnorm = Qwen4ExpTextRMSNorm(h, eps=c.rms_norm_eps), Qwen4ExpTextRMSNorm(h * streams, eps=c.rms_norm_eps)
    enorm.weight.data, hnorm.weight.data = tensors["mtp.pre_fc_norm_embedding.weight"], tensors["mtp.pre_fc_norm_hidden.weight"]
    tokens = torch.tensor([ref.tokens[:10]])
    t = tokens.shape[1]
    last = {}
    hf.model.layers[-1].register_forward_hook(lambda m, i, o: last.setdefault("streams", o))
    with torch.no_grad():
        hf(tokens)
        # Position p pairs the token at p with the streams at p - 1 (zeros before the first).
        before = torch.cat([torch.zeros(1, 1, h * streams), last["streams"][:, :-1]], dim=1)
        u = torch.nn.functional.linear(enorm(hf.model.embed_tokens(tokens)), tensors["mtp.fc_embedding.weight"])
        x = (torch.nn.functional.linear(hnorm(before).unflatten(-1, (streams, h)), tensors["mtp.fc_hidden.weight"])
             + u[:, :, None]).flatten(-2)
        cos, sin = hf.model.rotary_emb(x, torch.arange(t).view(1, 1, t).expand(3, 1, t))
        causal = torch.full((t, t), float("-inf")).triu(1)[None, None]
        expected = hf.lm_head(mixer(layer(x, position_embeddings=(cos, sin), attention_mask=causal)))[0]
    files = open_model(ref.path)
    draft = Qwen4ExpNextN(files.config, files.load_mtp(), "f32", 64, model.head_logits, model.embed_tokens)
    cache = KVCache(1, 1, 64, files.config.num_kv_heads, files.config.head_dim, specs=[DENSE])
    batch = ForwardBatch.build([Row(0, 0, ref.tokens[:10])])
    _, logits = draft(1, before[0], model.embed_tokens(tokens[0]), batch, cache)
    assert_matches(logits, expected)


def test_a_verify_block_runs_each_touched_expert_once(qwen, monkeypatch):
    _, model = qwen
    experts = model.layers[1].mlp
    monkeypatch.setattr(kernels, "usable", lambda x=None: False)  # the modules, whose calls hooks see
    calls = []
    hooks = [e.register_forward_hook(lambda m, i, o: calls.append(i[0].shape[0])) for e in experts.experts]
    try:
        x = torch.randn(4, model.config.hidden_size)
        _, chosen = experts.route(x)
        experts(x)
    finally:
        for h in hooks:
            h.remove()
    assert len(calls) == len(chosen.unique()) and sum(calls) == chosen.numel()


@pytest.fixture(scope="module", params=["f32", "q8_0"])
def served(qwen, request):
    """The tiny model in f32, or in q8_0 blocks with 8-bit activations where the kernels have them."""
    ref, _ = qwen
    files = open_model(ref.path)
    model = Transformer(files.config, files.load_tensors(), dtype=request.param, max_positions=64)
    use_activations(model, "q8" if request.param == "q8_0" and kernels.q8_activations_supported() else "f32")
    return model


def modules_alone(monkeypatch, module) -> None:
    """From here on `module` runs op by op from Python, each linear layer and each streams' norm by
    its own kernel call."""
    monkeypatch.setattr(kernels, "usable", lambda x=None: False)
    for m in module.modules():
        if isinstance(m, Linear):
            monkeypatch.setattr(m, "forward", lambda x, m=m: torch.ops.tandem.linear_rows(
                x, m.weight, m.scale, m.bias, m.q8_activations))
        if isinstance(m, GroupedRMSNorm):
            monkeypatch.setattr(m, "forward", lambda x, m=m: torch.ops.tandem.rms_norm(x, m.weight, m.eps, m.size))


@pytest.mark.parametrize("rows", [1, 4, 32])
def test_the_experts_kernel_gives_the_modules_numbers(served, monkeypatch, rows):
    # Decode and verify rows take the experts in one kernel call (experts_rows): routing, each
    # touched expert over its rows, the shared expert and its gate, bit for bit the modules' result.
    experts = served.layers[1].mlp
    x = torch.randn(rows, served.config.hidden_size, generator=torch.Generator().manual_seed(rows))
    with torch.inference_mode():
        fused = experts(x)
        modules_alone(monkeypatch, experts)
        assert torch.equal(fused, experts(x))


@pytest.mark.parametrize("rows", [1, 4, 32])
def test_the_hyper_connection_kernels_give_the_modules_numbers(served, monkeypatch, rows):
    # A hyper-connection's two halves around its block (hyper_mix, hyper_inject), and the final
    # mixer's, each in one call on a few rows: bit for bit the modules' result.
    layer, mixer = served.layers[0], served.mixer
    x = torch.randn(rows, served.config.hc_count * served.config.hidden_size,
                    generator=torch.Generator().manual_seed(rows))
    block = torch.nn.Linear(served.config.hidden_size, served.config.hidden_size)
    with torch.inference_mode():
        fused = layer.mlp_hyper_connection(x, block), mixer(x)
        modules_alone(monkeypatch, served)
        alone = layer.mlp_hyper_connection(x, block), mixer(x)
    assert all(torch.equal(a, b) for a, b in zip(fused, alone))


@pytest.mark.parametrize("override, message", [
    ({"hc_count": 1}, "hc_count=1: Qwen4-Exp needs more than one residual stream"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok=9: must be in [1, num_experts=8]"),
    ({"indexer_budget": 10}, "indexer_budget=10: must be a multiple of indexer_compress_ratio=4"),
    ({"indexer_head_dim": None}, "indexer_head_dim: missing from config.json (the QSA indexer needs all of "
                                 "indexer_n_heads, indexer_head_dim, indexer_budget, indexer_compress_ratio)"),
    ({"ple_layer_ids": [2]}, "ple_layer_ids: layer 2 must be a linear_attention layer in [1, 4]"),
    ({"output_gate_type": "relu"}, "output_gate_type='relu': must be silu or sigmoid"),
])
def test_bad_qwen4_exp_geometry_is_refused_naming_the_field(override, message):
    from engine.cli.tiny import tiny_config
    from engine.files.config_readers import from_hf_dict
    with pytest.raises(ConfigError) as e:
        from_hf_dict({**tiny_config("qwen4_exp"), "eos_token_id": 258, **override})
    assert str(e.value) == message


def test_the_compression_flags_are_refused_on_a_model_with_its_own_indexer(qwen):
    from engine.files.model_config import with_compression
    from engine.settings import CompressRatios
    _, model = qwen
    with pytest.raises(ConfigError) as e:
        with_compression(model.config, CompressRatios.parse("all:4"), None)
    assert str(e.value) == ("compress_ratios: this model's QSA is its indexer's (indexer_compress_ratio=4, "
                            "indexer_budget=8); the flag applies to models without one "
                            "(compress_ratios none makes every layer dense)")


def test_compress_ratios_none_makes_the_indexed_layers_dense_attention_without_index_storage(qwen, monkeypatch):
    # The dense twin QSA is measured against: the same logits as the indexed layers keeping every
    # position, and no indexer keys or block keys in the cache.
    from engine.files.model_config import with_compression
    from engine.files.weights import open_model
    from engine.model.transformer import Transformer
    from engine.settings import CompressRatios
    from tests.engine.test_parity import MAX_POSITIONS
    ref, model = qwen
    config, _ = with_compression(model.config, CompressRatios.parse("none"), None)
    dense = Transformer(config, open_model(ref.path).load_tensors(), dtype="f32", max_positions=MAX_POSITIONS)
    assert {s.kind for s in dense.specs} == {"recurrent", "dense"}
    cache = new_cache(dense, 1, STEPS)
    assert all(k is None for k in (*cache.ikeys, *cache.iblocks, *cache.kpool))
    (got,), = run(dense, [[Row(0, 0, ref.tokens)]])
    monkeypatch.setattr(qsa, "allowed", lambda scores, positions, length, *rule:
                        torch.arange(length) <= positions[:, None])
    (everything,), = run(model, [[Row(0, 0, ref.tokens)]])
    assert_matches(got, everything)


def test_an_n_gram_table_stored_in_blocks_is_read_row_by_row_as_its_widened_rows(qwen):
    # llama.cpp's converter writes the table in Q8_0 when asked for a q8_0 file and its rows (one
    # head's slice of the embedding) are whole blocks; tandem keeps it as stored and widens only the
    # rows a step reads. The tiny's rows are 4 wide, so these stand-in shards are 32 wide.
    from engine.ops.blocks import BlockTensor, dequantize, quantize
    _, model = qwen
    ple = next(m for m in model.modules() if hasattr(m, "shards"))
    ends = ple.shard_ends.tolist()
    sizes = [b - a for a, b in zip([0, *ends], ends)]
    stored = [BlockTensor("q8_0", quantize(torch.randn(n, 32), "q8_0"), 32) for n in sizes]
    ids = torch.randint(0, ends[-1], (5, ple.sizes.numel()))
    original = ple.shards
    try:
        ple.shards = [dequantize(b.data, "q8_0", 32) for b in stored]
        expected = ple.rows(ids)
        ple.shards = stored
        got = ple.rows(ids)
    finally:
        ple.shards = original
    assert got.shape == (5, ple.sizes.numel() * 32) and torch.equal(got, expected)


def test_a_verify_block_past_the_budget_reads_only_the_union_of_its_queries_selections(qwen, monkeypatch):
    # Its logits are the reference's (test_prompt_chunks_then_decode_past_the_budget_match runs such
    # blocks); here, the keys it attends: fewer than the context, at least the budget.
    from engine.model.attention import Attention
    ref, model = qwen
    read = []
    attend = Attention._attend
    monkeypatch.setattr(Attention, "_attend", lambda self, q, keys, values, mask, prefix=0:
                        read.append((q.shape[0], keys.shape[1])) or attend(self, q, keys, values, mask, prefix))
    start = len(ref.tokens) - 4
    run(model, [[Row(0, 0, ref.tokens[:start])], [Row(0, start, ref.tokens[start:])]])
    spec = next(s for s in model.specs if s.is_qsa)
    blocks = [keys for t, keys in read if t == 4]
    assert blocks and all(spec.budget < keys < len(ref.tokens) for keys in blocks)


@pytest.fixture(scope="module")
def ple_inside(tmp_path_factory):
    """The tiny model with its n-gram embedding on its third layer: the stack kernel runs the layers
    before it and from it in two calls, the embedding added between them."""
    from engine.cli.tiny import tiny_config, write_tiny_model
    return write_tiny_model(tiny_config("qwen4_exp", ple_layer_ids=[3]), tmp_path_factory.mktemp("ple3"), seed=1)


@pytest.mark.parametrize("settings, stack_steps", [({}, 10), ({"cache_type": "q8_0"}, 5), ({"kv_unified": True}, 10)])
def test_decode_steps_through_the_stack_kernel_give_the_modules_numbers(ple_inside, monkeypatch, settings, stack_steps):
    # Two slots decode side by side, slot 1 four positions behind: both within the QSA budget (2 blocks
    # of 4) for 5 steps, then slot 0 past it while slot 1 is not (the modules take those steps), then
    # both past it, each selecting its blocks (the kernel's, where K and V are f32; a q8_0 cache's
    # selected rows are the modules'). Every step's logits are the modules' to the bit.
    from engine.engine import Engine
    from engine.model import qwen4_exp
    from engine.settings import EngineConfig
    fused, alone = (Engine.load(EngineConfig(model=str(ple_inside), ctx_size=128, parallel=2, **settings))
                    for _ in range(2))
    kernel, taken, use_kernel = qwen4_exp.fused_layers, [], [True]
    monkeypatch.setattr(qwen4_exp, "fused_layers",
                        lambda *args: taken.append(kernel(*args)) or taken[-1] if use_kernel[0] else None)
    prompts = [[(7 * i + 3) % 300 + 5 for i in range(6)], [9, 17]]
    logits = {}
    with torch.inference_mode():
        for use_kernel[0], e in ((True, fused), (False, alone)):
            assert all(e.cache.ensure(s, 32) for s in range(2))  # a unified pool's pages taken
            e.model(ForwardBatch.build([Row(s, 0, p) for s, p in enumerate(prompts)]), e.cache)
            positions, tokens, out = [len(p) for p in prompts], [11, 12], []
            for _ in range(14):
                step = e.model.logits(e.model(ForwardBatch.build(
                    [Row(s, positions[s], [tokens[s]]) for s in range(2)]), e.cache))
                out.append(step)
                tokens, positions = step.argmax(-1).tolist(), [p + 1 for p in positions]
            logits[use_kernel[0]] = out
    assert sum(t is not None for t in taken) == stack_steps
    assert all(torch.equal(a, b) for a, b in zip(logits[True], logits[False]))
