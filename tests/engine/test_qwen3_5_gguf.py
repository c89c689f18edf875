"""Qwen3.5 GGUF files as llama.cpp's own converter writes them (tests/fixtures/qwen3_5, remade by its
remake.py): tandem reads them exactly, gives llama-server's greedy tokens on them, and with
--spec-type draft-mtp drafts and keeps the very tokens llama-server does, over the model's own MTP
layer and over the MTP-only file given as the draft."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine.engine import Engine
from engine.errors import ConfigError
from engine.files.weights import open_model
from engine.model.batch import Row
from engine.sched.sampling import SamplingParams
from engine.settings import EngineConfig, SpecConfig
from tests.engine.runs import run_all
from tests.engine.test_parity import assert_matches, load_engine_model, new_cache, one_thread, reference, step  # noqa: F401
from tests.exact_tokens import assert_same_greedy, next_token_logits

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3_5"
MODEL, MTP_ONLY = FIXTURES / "tiny-qwen3_5-f32.gguf", FIXTURES / "mtp-tiny-qwen3_5-f32.gguf"
LLAMA = json.loads((FIXTURES / "llama_server.json").read_text())
SPECS = {"plain": None, "draft-mtp": SpecConfig(type="draft-mtp", n_max=LLAMA["n_max"], p_min=0.0, pacing=False),
         "draft-mtp -md": SpecConfig(type="draft-mtp", draft_model=str(MTP_ONLY), n_max=LLAMA["n_max"], p_min=0.0,
                                     pacing=False)}


def test_the_converted_file_reads_as_the_checkpoint_it_came_from(reference):
    ref = reference("qwen3_5")  # the same seed and config the fixture was converted from
    files = open_model(MODEL)
    lin = files.config.linear
    assert (lin.num_k_heads, lin.num_v_heads, lin.tiled_v_heads) == (2, 4, True)
    assert files.config.num_nextn_predict_layers == 1 and files.has_mtp
    model = load_engine_model(MODEL)
    (logits,), = [step(model, new_cache(model, 1, 4), [Row(0, 0, ref.tokens)])]
    assert_matches(logits, ref.logits)


@pytest.fixture(scope="module")
def answers():
    """tandem's greedy answer and draft counts on each recorded prompt, per llama-server record."""
    out = {}
    for key in LLAMA["answers"]:
        fmt, mode = key.split(" ", 1)
        engine = Engine.load(EngineConfig(model=str(FIXTURES / f"tiny-qwen3_5-{fmt}.gguf"), dtype="auto",
                                          ctx_size=512, spec=SPECS[mode]))
        params = SamplingParams(temperature=0, max_tokens=LLAMA["n_predict"], ignore_eos=True)
        out[key] = run_all(engine, LLAMA["prompts"], params), engine
    return out


@pytest.mark.parametrize("key", ["f32 plain", "q8_0 plain"])
def test_greedy_tokens_equal_llama_servers(answers, key):
    requests, engine = answers[key]
    for request, theirs in zip(requests, LLAMA["answers"][key]):
        assert_same_greedy(request.output_ids, theirs["tokens"], request.prompt_ids, next_token_logits(engine.model))


@pytest.mark.parametrize("key", ["f32 draft-mtp", "f32 draft-mtp -md"])
def test_the_mtp_draft_keeps_what_llama_servers_keeps(answers, key):
    requests, _ = answers[key]
    ours = [(r.output_ids, r.draft_n, r.draft_n_accepted) for r in requests]
    theirs = [(a["tokens"], a["draft_n"], a["draft_n_accepted"]) for a in LLAMA["answers"][key]]
    assert ours == theirs
    assert sum(r.draft_n - r.draft_n_accepted for r in requests) > 0, "some drafts are rejected and rolled back"


def test_a_model_file_without_mtp_layers_is_refused_as_a_draft(tiny_model):
    with pytest.raises(ConfigError, match=r"spec_draft_model=.*: holds no MTP layers"):
        Engine.load(EngineConfig(model=str(MODEL), ctx_size=64, spec=SpecConfig(type="draft-mtp",
                                                                                  draft_model=str(tiny_model))))


def test_trees_are_refused_on_a_recurrent_model_naming_the_rule():
    with pytest.raises(ConfigError, match=r"spec_draft_width=3: must be 1 on a model with linear_attention "
                                          r"\(recurrent\) layers"):
        Engine.load(EngineConfig(model=str(MODEL), ctx_size=64, spec=SpecConfig(type="draft-mtp", width=3)))


@pytest.mark.parametrize("spec", [None, SPECS["draft-mtp"]])
def test_the_fit_estimate_counts_the_recurrent_states_the_engine_allocates(spec):
    from engine.footprint import device_needs
    from engine.preflight import read_headers
    config = EngineConfig(model=str(MODEL), dtype="f32", ctx_size=256, parallel=2, spec=spec)
    headers = read_headers(config)
    [need] = device_needs(config, headers.model, headers.placement, headers.draft).values()
    engine = Engine.load(config, headers)
    [cpu] = engine.devices
    assert engine.cache.recurrent_nbytes > 0 and need.kv == cpu.kv_bytes
    weights = sum(b.nbytes for layer in engine.model.layers for b in layer.buffers()) + \
        engine.model.lm_head.weight.nbytes  # tied: the embedding's table
    if spec is not None:  # the MTP layer's own weights; it shares the target's lm_head and embedding
        weights += sum(b.nbytes for b in engine.drafter.model.buffers()) - engine.drafter.model.cos.nbytes \
            - engine.drafter.model.sin.nbytes
    assert need.weights == weights


def test_a_probe_of_a_recurrent_layer_is_refused_naming_it():
    from engine.model.probe import ProbeSpec
    engine = Engine.load(EngineConfig(model=str(MODEL), ctx_size=64))
    engine.admission.check_probe(ProbeSpec(layers=(1,)), 10)  # an attention layer
    with pytest.raises(ConfigError, match=r"attention_probe.layers=0: is a linear_attention \(recurrent\) layer"):
        engine.admission.check_probe(ProbeSpec(layers=(0,)), 10)
