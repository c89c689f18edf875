"""A model split into stages (engine/placement.py) computes what the unsplit model does: two and three
CPU stages give the same logits (within 1e-5) and the same greedy tokens (the exact-token rule), for
prefill, decode, parallel slots, MTP speculation, a q8_0 cache and the unified pool. The placement's
rules (splits, proportions) and what each device is reported to hold."""
from __future__ import annotations

import pytest
import torch

from engine.cli.tiny import tiny_config, write_tiny_model
from engine.engine import Engine
from engine.errors import ConfigError
from engine.files.weights import open_model
from engine.footprint import device_needs, estimated_format, measure
from engine.model.batch import ForwardBatch, Row
from engine.model.kv_cache import KV_DTYPES, KVCache, PagedKVCache
from engine.model.transformer import Transformer, embed_rows, embedding_table
from engine.ops import kernels
from engine.ops.arena import move_to_huge_pages
from engine.placement import Placement, split_by_proportions
from engine.preflight import read_headers
from engine.sched.sampling import SamplingParams
from engine.settings import CompressRatios, EngineConfig, SpecConfig
from tests.engine.runs import run_all
from tests.engine.test_qsa_engine import write_llama8_with_drafts
from tests.exact_tokens import assert_same_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [200, 3, 3, 71, 12]]
SPLITS = {"two stages": Placement(("cpu", "cpu"), (3, 5)), "three stages": Placement(("cpu",) * 3, (2, 3, 3))}


@pytest.fixture(scope="module")
def llama8(tmp_path_factory):
    """An eight-layer tiny Llama (QSA layers where a test asks) and an MTP draft for it."""
    return write_llama8_with_drafts(tmp_path_factory.mktemp("llama8"))


def step_logits(model: Transformer, cache, steps: list[list[Row]]) -> torch.Tensor:
    """Every token's logits over the steps, in order."""
    out = []
    for rows in steps:
        if isinstance(cache, PagedKVCache):
            for row in rows:
                cache.ensure(row.slot, row.start + len(row.tokens))
        out.append(model.logits(model(ForwardBatch.build(rows), cache)))
    return torch.cat(out)


# Two slots' prompts in one step (each chunk of several rows), a second chunk, then decodes.
STEPS = [[Row(0, 0, PROMPTS[0]), Row(1, 0, PROMPTS[1])], [Row(0, 7, [9, 10, 11])],
         [Row(0, 10, [4]), Row(1, 5, [8])], [Row(0, 11, [6]), Row(1, 6, [1])]]


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("dtype,cache_type,unified", [("f32", "f32", False), ("int8", "f32", False),
                                                      ("bf16", "bf16", False), ("f32", "q8_0", False),
                                                      ("f32", "f32", True)])
def test_split_logits_equal_unsplit(llama8, split, dtype, cache_type, unified):
    files = open_model(str(llama8))
    c, tensors = files.config, files.load_tensors()
    logits = []
    for placement in (Placement.single(c.num_layers), SPLITS[split]):
        model = Transformer(c, tensors, dtype, max_positions=64, placement=placement)
        kind = PagedKVCache if unified else KVCache
        cache = kind(c.num_layers, 2, 64 if unified else 32, c.num_kv_heads, c.head_dim, KV_DTYPES[cache_type],
                     devices=placement.layer_devices())
        with torch.inference_mode():
            logits.append(step_logits(model, cache, STEPS))
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-5)


def unsplit_logits(engine: Engine):
    """The next-token logits after `ids`, from the unsplit engine's model on a cache of its own."""
    def logits(ids: list[int]) -> torch.Tensor:
        c = engine.model.config
        cache = KVCache(c.num_layers, 1, len(ids), c.num_kv_heads, c.head_dim, engine.model.compute_dtype,
                        specs=engine.model.specs)
        return engine.model.logits(engine.model(ForwardBatch.build([Row(0, 0, ids)]), cache))[-1]
    return logits


CONFIGS = {
    "plain": {},
    "q8_0 cache": {"cache_type": "q8_0"},
    "unified pool": {"kv_unified": True},
    "qsa layers": {"compress_ratios": CompressRatios.parse("every4:4"), "qsa_budget": 8},
    "mtp speculation": {"spec": True},
}


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("name", CONFIGS)
def test_split_engine_greedy_equals_unsplit_for_two_parallel_slots(llama8, split, name):
    options = dict(CONFIGS[name])
    if options.get("spec"):
        options["spec"] = SpecConfig(type="draft-mtp", draft_model=str(llama8 / "draft.safetensors"), n_max=3,
                                     p_min=0.0)
    base = dict(model=str(llama8), ctx_size=256, parallel=2, **options)
    unsplit = Engine.load(EngineConfig(**base))
    placement = SPLITS[split]
    split_engine = Engine.load(EngineConfig(**base, devices=placement.devices, layer_split=placement.layer_split))
    assert [len(s.layers) for s in split_engine.model.stages] == list(placement.layer_split)
    expected = [r.output_ids for r in run_all(unsplit, PROMPTS, GREEDY)]
    got = [r.output_ids for r in run_all(split_engine, PROMPTS, GREEDY)]
    for prompt, g, e in zip(PROMPTS, got, expected):
        assert_same_greedy(g, e, prompt, unsplit_logits(unsplit))
    if options.get("spec"):
        assert split_engine.stats.drafted_at, "the draft never drafted"


def test_default_model_split_in_two_equals_unsplit(default_engine):
    """The default model, 15 layers per stage, one short prompt: prefill and decode."""
    split = Engine.load(EngineConfig(model="default", ctx_size=512, parallel=1, devices=("cpu", "cpu"),
                                     layer_split=(15, 15)))
    prompt = default_engine.tokenizer.encode("The capital of France is")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [r.output_ids for r in run_all(default_engine, [prompt], params)][0]
    got = [r.output_ids for r in run_all(split, [prompt], params)][0]
    assert_same_greedy(got, expected, prompt, unsplit_logits(default_engine))
    c = default_engine.model.config
    with torch.inference_mode():
        logits = [step_logits(e.model, KVCache(c.num_layers, 1, 64, c.num_kv_heads, c.head_dim),
                              [[Row(0, 0, prompt)]]) for e in (default_engine, split)]
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-5)


def test_a_split_reports_each_devices_stages_layers_and_bytes(llama8):
    engine = Engine.load(EngineConfig(model=str(llama8), ctx_size=64, parallel=2, devices=("cpu", "cpu"),
                                      layer_split=(3, 5)))
    [cpu] = engine.devices  # both stages share the CPU's memory: one device
    assert (cpu.device, cpu.stages, cpu.layers) == ("cpu", [0, 1], list(range(8)))
    assert cpu.kv_bytes == engine.cache.nbytes + engine.cache.kpool_nbytes
    assert cpu.weight_bytes >= sum(b.nbytes for layer in engine.model.layers for b in layer.buffers())
    assert cpu.embedding_copies == 1  # tied, and the lm_head on the embedding's device: read from its rows
    assert [(s.first, s.last) for s in engine.model.stages] == [(True, False), (False, True)]


def test_the_cpu_kernels_only_read_cpu_tensors():
    """A stage on another device runs torch's ops: the kernels are CPU code."""
    with torch.inference_mode():
        assert kernels.usable(torch.empty(1))
        assert not kernels.usable(torch.empty(1, device="meta"))


def test_huge_pages_take_only_cpu_buffers():
    cpu, elsewhere = torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024, device="meta")
    module = torch.nn.Sequential(cpu, elsewhere)
    before = cpu.weight.data_ptr()
    for m in (cpu, elsewhere):
        m.register_buffer("w", m.weight.detach())
    move_to_huge_pages(module, "w")
    assert elsewhere.w.is_meta and cpu.w.is_cpu and torch.equal(cpu.w, cpu.weight.detach()) \
        and cpu.w.data_ptr() != before


@pytest.mark.parametrize("proportions,layers,expected", [
    ((1, 1), 30, (15, 15)),
    ((1, 1), 3, (2, 1)),  # 1.5 rounds half up
    ((3, 1), 30, (23, 7)),  # 22.5 -> 23
    ((1, 1, 1), 30, (10, 10, 10)),
    ((0.5, 0.25, 0.25), 8, (4, 2, 2)),
    ((2, 0, 1), 9, (6, 0, 3)),
])
def test_tensor_split_proportions_round_each_boundary_half_up(proportions, layers, expected):
    assert split_by_proportions(proportions, layers) == expected
    assert sum(expected) == layers


def test_stages_hold_consecutive_layers():
    p = Placement(("cpu", "cuda:0", "cuda:1"), (10, 10, 10))
    assert p.stage_ranges() == [range(0, 10), range(10, 20), range(20, 30)]
    assert [p.stage_of(i) for i in (0, 9, 10, 29)] == [0, 0, 1, 2]
    assert p.layer_devices()[9:11] == ["cpu", "cuda:0"]
    assert Placement.single(30) == Placement(("cpu",), (30,), "cpu")


@pytest.mark.parametrize("kwargs,message", [
    ({"devices": ("cpu", "cpu"), "layer_split": (10, 10)}, "layer_split='10,10': must sum to the model's 30 trunk "
                                                             "layers, not 20"),
    ({"devices": ("cpu", "cpu"), "layer_split": (30,)}, "layer_split='30': must give one entry per device "
                                                        "(2: cpu,cpu), not 1"),
    ({"devices": ("cpu", "cpu"), "tensor_split": (1, 1, 1)}, "tensor_split='1,1,1': must give one entry per device "
                                                             "(2: cpu,cpu), not 3"),
    ({"devices": ("cpu", "cpu"), "tensor_split": (1, 0)}, "tensor_split='1,0': gives a device no layers of the "
                                                          "model's 30 (split 30,0); every device needs at least one"),
    ({"devices": ("cpu", "cpu"), "layer_split": (15, 15), "tensor_split": (1, 1)},
     "tensor_split='1,1': cannot be given with layer_split"),
])
def test_a_split_that_does_not_fit_the_trunk_names_field_value_and_rule(kwargs, message):
    with pytest.raises(ValueError) as e:
        Placement.resolve(30, **kwargs)
    assert str(e.value) == message


def test_no_split_spreads_the_layers_as_evenly_as_they_go():
    assert Placement.resolve(30, ("cpu", "cuda:0")).layer_split == (15, 15)
    assert Placement.resolve(30, ("cpu", "cuda:0", "cuda:1", "cuda:2")).layer_split == (8, 7, 8, 7)


@pytest.mark.parametrize("kwargs,message", [
    ({"devices": ("cpu", "gpu")}, "devices=('cpu', 'gpu'): must be one or more of cpu, cuda:N"),
    ({"devices": ()}, "devices=(): must be one or more of cpu, cuda:N"),
    ({"draft_device": "cuda"}, "draft_device='cuda': must be cpu or cuda:N"),
])
def test_an_engine_config_takes_device_names_as_the_flags_give_them(kwargs, message):
    with pytest.raises(ConfigError) as e:
        EngineConfig(**kwargs)
    assert str(e.value) == message


@pytest.mark.parametrize("dtype", ["f32", "int8", "bf16"])
@pytest.mark.parametrize("name", ["llama", "mistral"])  # tied, untied
def test_an_embedding_copy_embeds_exactly_what_the_model_does(tmp_path, name, dtype):
    """A first stage or a draft on another device than the lm_head gets its own table: the same rows,
    in the same format (a tied table's int8 rows, not the f32 ones)."""
    config = tiny_config(name)
    files = open_model(str(write_tiny_model(config, tmp_path / name, seed=3)))
    tensors = files.load_tensors()
    model = Transformer(files.config, tensors, dtype, max_positions=16)
    ids = torch.tensor([0, 5, 300, 5])
    copy = embed_rows(embedding_table(files.config, tensors, dtype), ids, model.compute_dtype)
    assert torch.equal(copy, model.embed_tokens(ids))


def test_a_draft_with_its_own_embedding_counts_as_a_copy_on_its_device(llama8):
    spec = SpecConfig(type="draft-mtp", draft_model=str(llama8 / "draft.safetensors"))
    engine = Engine.load(EngineConfig(model=str(llama8), ctx_size=64, parallel=1, spec=spec))
    draft = engine.drafter.model
    assert draft.embed is None  # the target's first stage is on the draft's device: shared
    [cpu] = measure(engine.model, engine.cache, "cpu", draft, engine.drafter.cache)
    assert (cpu.embedding_copies, cpu.draft) == (1, True)
    files = open_model(str(llama8))
    draft.embed = embedding_table(files.config, files.load_tensors(), "f32")  # as on another device
    [cpu] = measure(engine.model, engine.cache, "cpu", draft, engine.drafter.cache)
    assert cpu.embedding_copies == 2
    ids = torch.tensor([3, 9])
    assert torch.equal(draft.embed_tokens(ids), engine.model.embed_tokens(ids))


@pytest.mark.parametrize("options", [{}, {"kv_unified": True}, {"cache_type": "bf16", "dtype": "int8"},
                                     {"compress_ratios": CompressRatios.parse("every4:4"), "qsa_budget": 8}])
def test_the_fit_estimate_is_what_the_engine_allocates(llama8, options):
    """The check before load counts the same K, V, pooled keys and layer and lm_head weights as the
    engine then allocates."""
    config = EngineConfig(model=str(llama8), ctx_size=256, parallel=2, devices=("cpu", "cpu"), **options)
    headers = read_headers(config)
    [need] = device_needs(config, headers.model, headers.placement, headers.draft).values()
    engine = Engine.load(config, headers)
    [cpu] = engine.devices
    assert need.kv == cpu.kv_bytes
    weights = sum(b.nbytes for layer in engine.model.layers for b in layer.buffers()) + \
        sum(b.nbytes for b in engine.model.lm_head.buffers())
    assert need.weights == weights


def test_under_auto_the_fit_estimate_counts_the_widest_format_the_file_keeps():
    """--dtype auto keeps a GGUF file's matrices in blocks (other types than Q4_0/Q4_1/Q5_0/Q8_0 in the
    nearest of those): the default model's widest is its Q8_0 embedding; a plain F16 matrix, and an HF
    model's weights, load as f32."""
    stored = open_model("default").stored
    assert estimated_format("auto", stored) == "q8_0"
    assert estimated_format("auto", {**stored, "model.layers.0.mlp.up_proj.weight": (14, 0)}) == "q8_0"  # Q6_K
    assert estimated_format("auto", {**stored, "model.layers.0.mlp.up_proj.weight": (1, 0)}) == "f32"  # F16
    assert estimated_format("auto", {}) == "f32"
    assert estimated_format("int8", stored) == "int8"
