"""Attention probes (engine/model/probe.py): head_mean equals transformers' eager attention weights reduced
the same way, qk its post-RoPE q and k; a probe changes no token, leaves unprobed steps on the fused
kernel, reads the same through a cached prefix, and keeps each slot's probe its own."""
from __future__ import annotations

import functools
import importlib

import numpy as np
import pytest
import torch

from engine.cli.tiny import write_tiny_model
from engine.engine import Engine
from engine.errors import ConfigError
from engine.model.probe import MAX_LAYERS, MAX_POSITIONS, ProbeSpec, Window
from engine.ops import kernels
from engine.sched.request import Request
from engine.sched.sampling import SamplingParams
from engine.settings import CompressRatios, EngineConfig
from tests.engine.runs import run_all
from tests.engine.test_parity import one_thread, tiny_config  # noqa: F401 (one_thread: autouse)
from tests.engine.test_qsa_engine import write_llama8_with_drafts

TOLERANCE = 1e-5  # f32, tiny models
DEFAULT_TOLERANCE = 1e-4  # f32, the default model
PROMPT = [(11 * i + 7) % 250 + 20 for i in range(37)]  # three chunks of UBATCH, groups of 4 with a short last
UBATCH = 16
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
N = len(PROMPT)
QUERIES = {"last": [N - 1], 5: [5], -3: [N - 3], Window(6): list(range(N - 6, N)), "all": list(range(N))}  # and their positions


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """tiny(name) -> (model directory, an engine of two slots on it), each made once."""
    @functools.cache
    def make(name: str):
        path = write_tiny_model(tiny_config(name), tmp_path_factory.mktemp(name))
        return path, Engine.load(EngineConfig(model=str(path), ctx_size=256, parallel=2, ubatch_size=UBATCH))
    return make


def probe_one(engine: Engine, spec: ProbeSpec | None, prompt: list[int] = PROMPT, cache_prompt: bool = True) -> Request:
    return run_all(engine, [prompt], GREEDY, [spec], cache_prompt)[0]


def transformers_run(path, ids: list[int], module_name: str):
    """transformers with eager attention on `ids`: per layer the attention weights [heads, P, P]
    and the post-RoPE q [P, heads, d] and k [P, kv_heads, d], captured by wrapping the modeling
    module's apply_rotary_pos_emb."""
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    return eager_run(hf, ids, module_name)


def eager_run(hf, ids: list[int], module_name: str):
    module = importlib.import_module(f"transformers.models.{module_name}.modeling_{module_name}")
    rotate, captured = module.apply_rotary_pos_emb, []

    def capture(q, k, *args, **kwargs):
        q, k = rotate(q, k, *args, **kwargs)
        captured.append((q[0].transpose(0, 1), k[0].transpose(0, 1)))
        return q, k

    module.apply_rotary_pos_emb = capture
    try:
        with torch.no_grad():
            attentions = hf(torch.tensor([ids]), output_attentions=True).attentions
    finally:
        module.apply_rotary_pos_emb = rotate
    return [a[0] for a in attentions], captured


def reduced(attention: torch.Tensor, spec: ProbeSpec, kv_heads: int, positions: list[int]) -> torch.Tensor:
    """The head_mean result written out from a full [heads, P, P] matrix."""
    rows = attention.mean(0, keepdim=True) if spec.reduce == "mean" else attention.unflatten(0, (kv_heads, -1)).mean(1)
    g = spec.group

    def groups(v: torch.Tensor, end: int) -> torch.Tensor:  # v [R, end] -> [R, ceil(end/g)]
        return torch.stack([v[:, s:min(s + g, end)].mean(1) for s in range(0, end, g)], -1)

    if spec.query == "all":
        n = attention.shape[1]
        out = torch.zeros(rows.shape[0], n, -(-n // g))
        for i in range(n):
            part = groups(rows[:, i, :i + 1], i + 1)
            out[:, i, :part.shape[1]] = part
    else:
        end = positions[-1] + 1
        out = groups(rows[:, positions, :end].mean(1), end)
    return out[0] if spec.reduce == "mean" else out


def assert_close(got: torch.Tensor, expected: torch.Tensor, tolerance: float, what: str) -> None:
    assert got.shape == expected.shape, f"{what}: shape {list(got.shape)}, expected {list(expected.shape)}"
    diff = float((got - expected).abs().max())
    assert diff <= tolerance, f"{what}: max abs difference {diff:.3g} (> {tolerance})"


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_head_mean_equals_transformers_eager_attentions(tiny, name):
    path, engine = tiny(name)
    config = engine.model.config
    attentions, _ = transformers_run(path, PROMPT, name)
    for query, positions in QUERIES.items():
        for reduce in ("mean", "none"):
            spec = ProbeSpec((0, -1), query=query, group=4, reduce=reduce)
            req = probe_one(engine, spec)
            for layer, result in zip((0, config.num_layers - 1), req.probe_result):
                assert result.layer == layer and result.query_positions == positions and not result.sparse
                assert_close(result.tensors["values"], reduced(attentions[layer], spec, config.num_kv_heads, positions),
                             TOLERANCE, f"{name} layer {layer} query {query} reduce {reduce}")


def test_an_indexed_layers_head_mean_equals_transformers_eager_attention_under_its_selection(tiny):
    """Qwen4-Exp's attention layers 1 and 3 select through the model's indexer (a budget of 2 blocks
    of 4): past it each query's weights fall on its kept blocks and tail only, as transformers'
    eager attention masks them."""
    from transformers import AutoModelForCausalLM
    path, engine = tiny("qwen4_exp")
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        attentions = [a[0] for a in hf(torch.tensor([PROMPT]), output_attentions=True).attentions]  # layers 1, 3
    for reduce in ("mean", "none"):
        spec = ProbeSpec((1, 3), query="all", group=4, reduce=reduce)
        for attention, result in zip(attentions, probe_one(engine, spec).probe_result):
            assert result.sparse
            assert_close(result.tensors["values"], reduced(attention, spec, engine.model.config.num_kv_heads, QUERIES["all"]),
                         TOLERANCE, f"qwen4_exp layer {result.layer} reduce {reduce}")


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_qk_equals_transformers_post_rope_q_and_k(tiny, name):
    path, engine = tiny(name)
    _, captured = transformers_run(path, PROMPT, name)
    for query in ("last", Window(6), "all"):
        req = probe_one(engine, ProbeSpec((1, 0), kind="qk", query=query))
        positions = QUERIES[query]
        for layer, result in zip((1, 0), req.probe_result):
            q, k = captured[layer]
            assert result.key_positions == range(len(PROMPT))
            assert_close(result.tensors["q"], q[positions], TOLERANCE, f"{name} layer {layer} q, query {query}")
            assert_close(result.tensors["k"], k, TOLERANCE, f"{name} layer {layer} k")


def test_default_model_head_mean_equals_transformers(default_engine, hf_default_model):
    ids = default_engine.tokenizer.encode("The quick brown fox jumps over the lazy dog, and then")
    implementation = hf_default_model.config._attn_implementation
    hf_default_model.set_attn_implementation("eager")
    try:
        attentions, _ = eager_run(hf_default_model, ids, "llama")
    finally:
        hf_default_model.set_attn_implementation(implementation)
    spec = ProbeSpec((3, -1), query="all", group=2, reduce="none")
    req = probe_one(default_engine, spec, ids)
    config = default_engine.model.config
    for layer, result in zip((3, config.num_layers - 1), req.probe_result):
        assert_close(result.tensors["values"], reduced(attentions[layer], spec, config.num_kv_heads, list(range(len(ids)))),
                     DEFAULT_TOLERANCE, f"default model layer {layer}")


def test_a_group_longer_than_the_prompt_is_one_group(tiny):
    _, engine = tiny("llama")
    (result,) = probe_one(engine, ProbeSpec((0,), group=10**12)).probe_result
    # The mean of weights that sum to 1 over the prompt's keys.
    assert_close(result.tensors["values"], torch.tensor([1 / len(PROMPT)]), 1e-7, "one group")


def test_a_probe_changes_no_token_and_all_queries_recompute_the_prompt(tiny):
    _, engine = tiny("qwen2")
    plain = probe_one(engine, None)
    last = probe_one(engine, ProbeSpec((0,)))
    everything = probe_one(engine, ProbeSpec((0,), query="all"))
    assert last.output_ids == everything.output_ids == plain.output_ids
    # The same prompt again: "last" reads its cached prefix, "all" runs it whole and says so.
    assert last.timings().cache_n == len(PROMPT) - 1 and not last.timings().probe_recomputed
    assert everything.timings().cache_n == 0 and everything.timings().probe_recomputed


def test_unprobed_steps_take_the_fused_kernel(tiny, monkeypatch):
    _, engine = tiny("llama")
    calls = []
    fused = kernels.decoder_layers
    monkeypatch.setattr(kernels, "decoder_layers", lambda *a: calls.append(1) or fused(*a))

    def fused_and_steps(spec: ProbeSpec | None) -> tuple[int, int]:
        calls.clear()
        steps = engine.stats.steps
        req = probe_one(engine, spec)
        assert req.cache_n == len(PROMPT) - 1  # the prompt's last token runs alone: a fused-size step
        return len(calls), engine.stats.steps - steps

    probe_one(engine, None)  # caches the prompt
    calls_plain, steps_plain = fused_and_steps(None)
    assert calls_plain == steps_plain  # the last prompt token and every decode step
    calls_probed, steps_probed = fused_and_steps(ProbeSpec((1,)))
    assert (calls_probed, steps_probed) == (steps_plain - 1, steps_plain)  # only the probed token's step runs by module


def test_cached_prefix_and_fresh_prompt_give_the_same_values(tiny):
    _, engine = tiny("qwen3")
    spec = ProbeSpec((0, 1), query=Window(3), group=3)
    fresh = probe_one(engine, spec, cache_prompt=False)
    probe_one(engine, None)
    cached = probe_one(engine, ProbeSpec((0, 1)), cache_prompt=True)
    fresh_last = probe_one(engine, ProbeSpec((0, 1)), cache_prompt=False)
    assert cached.cache_n == len(PROMPT) - 1 and fresh_last.cache_n == 0 and fresh.cache_n == 0
    for a, b in zip(cached.probe_result, fresh_last.probe_result):
        assert_close(a.tensors["values"], b.tensors["values"], 1e-6, f"layer {a.layer} cached vs fresh")


def test_the_unified_pool_gives_the_per_slot_cache_values(tiny):
    path, engine = tiny("qwen3")
    unified = Engine.load(EngineConfig(model=str(path), ctx_size=256, parallel=2, ubatch_size=UBATCH, kv_unified=True))
    for spec in (ProbeSpec((1,), query="all", group=3), ProbeSpec((0,), kind="qk", query=Window(2))):
        a, b = (probe_one(e, spec).probe_result[0] for e in (engine, unified))
        for name in a.tensors:
            assert_close(b.tensors[name], a.tensors[name], 1e-6, f"{spec.kind} {name}, unified vs per slot")


def test_two_slots_probing_different_layers_at_once_get_their_own(tiny):
    _, engine = tiny("qwen2")
    other = PROMPT[5:30]
    specs = [ProbeSpec((0,), query="all", group=2), ProbeSpec((1,), query=Window(4), reduce="none")]
    together = run_all(engine, [PROMPT, other], GREEDY, specs)
    alone = [probe_one(engine, spec, prompt, cache_prompt=False) for spec, prompt in zip(specs, [PROMPT, other])]
    for t, a in zip(together, alone):
        assert [r.layer for r in t.probe_result] == [r.layer for r in a.probe_result]
        assert_close(t.probe_result[0].tensors["values"], a.probe_result[0].tensors["values"], 1e-6,
                     f"layer {a.probe_result[0].layer} together vs alone")


def test_a_qsa_layer_reports_the_kept_blocks_it_attended(tmp_path):
    path = write_llama8_with_drafts(tmp_path)
    engine = Engine.load(EngineConfig(model=str(path), ctx_size=256, parallel=1, ubatch_size=UBATCH,
                                      compress_ratios=CompressRatios.parse("every4:4"), qsa_budget=8))
    req = probe_one(engine, ProbeSpec((0, 3), query="all"))
    dense, sparse = req.probe_result
    assert not dense.sparse and sparse.sparse
    for p in range(len(PROMPT)):
        # Past the budget (more than two complete blocks of 4 up to itself), a query of the QSA
        # layer attends two kept blocks plus its tail, the rest of its own block (empty at a
        # block's end); within it, every key up to itself.
        kept = 8 + (p + 1) % 4 if (p + 1) // 4 > 2 else p + 1
        assert int((sparse.tensors["values"][p] > 0).sum()) == kept, f"query {p}"
        assert int((dense.tensors["values"][p] > 0).sum()) == p + 1
        assert abs(float(sparse.tensors["values"][p].sum()) - 1) < 1e-5


def test_the_command_saves_and_plots_the_values(tiny, tmp_path, monkeypatch, capsys):
    from engine.cli import probe
    path, _ = tiny("llama")
    out, plot = tmp_path / "values.npy", tmp_path / "strip.png"
    monkeypatch.setattr("sys.argv", ["probe", "-m", str(path), "--prompt", "a short prompt", "--layers", "0,-1",
                                     "--group", "3", "--out", str(out), "--plot", str(plot)])
    probe.main()
    values = np.load(out)
    assert values.shape == (2, 5)  # 14 byte tokens in groups of 3
    assert np.allclose((values * [3, 3, 3, 3, 2]).sum(1), 1, atol=1e-5)
    assert plot.stat().st_size > 0 and "layer 2: values [5] over key positions 0..13" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, field", [
    ({"layers": ()}, "attention_probe.layers"),
    ({"layers": tuple(range(MAX_LAYERS + 1))}, "attention_probe.layers"),
    ({"layers": (0,), "kind": "keys"}, "attention_probe.kind"),
    ({"layers": (0,), "query": "first"}, "attention_probe.query"),
    ({"layers": (0,), "query": Window(0)}, "attention_probe.query.last"),
    ({"layers": (0,), "query": Window(MAX_POSITIONS + 1)}, "attention_probe.query.last"),
    ({"layers": (0,), "group": 0}, "attention_probe.group"),
    ({"layers": (0,), "reduce": "max"}, "attention_probe.reduce"),
    ({"layers": (0,), "kind": "qk", "group": 2}, "attention_probe.group"),
    ({"layers": (0,), "kind": "qk", "reduce": "none"}, "attention_probe.reduce"),
])
def test_bad_specs_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=rf"^{field}="):
        ProbeSpec(**kwargs)


@pytest.mark.parametrize("spec, n_prompt, field", [
    (ProbeSpec((2,)), 10, "attention_probe.layers"),
    (ProbeSpec((-3,)), 10, "attention_probe.layers"),
    (ProbeSpec((1, -1)), 10, "attention_probe.layers"),  # the same layer twice
    (ProbeSpec((0,), query=10), 10, "attention_probe.query"),
    (ProbeSpec((0,), query=-11), 10, "attention_probe.query"),
    (ProbeSpec((0,), query=Window(11)), 10, "attention_probe.query.last"),
    (ProbeSpec((0,), query="all"), MAX_POSITIONS + 1, "attention_probe.query"),
    (ProbeSpec((0,), kind="qk"), MAX_POSITIONS + 1, "attention_probe.kind"),
])
def test_specs_beyond_the_model_or_prompt_are_refused_naming_the_field(spec, n_prompt, field):
    with pytest.raises(ConfigError, match=rf"^{field}="):
        spec.check(num_layers=2, n_prompt=n_prompt)
