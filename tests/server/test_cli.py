"""llama-server's flag names map onto EngineConfig and ServerSettings; bad combinations fail early."""
import subprocess
import sys

import pytest
import torch

from engine.errors import ConfigError
from engine.model.kv_cache import KV_DTYPES
from engine.ops import blocks
from engine.ops.quant import compute_dtype
from engine.settings import BLOCK_DTYPES, DEFAULT_DRAFT, DTYPES, KV_CACHE_TYPES
from server.cli import parse
from server.flags import AUTO_PARALLEL, FlagError, parse_flags
from tests.server.helpers import ROOT


def test_llama_server_flags_map_onto_the_configs():
    engine, settings = parse(["-m", "x", "-c", "8192", "-np", "4", "-b", "512", "-ub", "64", "-t", "2",
                              "--dtype", "bf16", "--kv-unified", "-ctk", "q8_0", "-ctv", "f16", "--alias", "a",
                              "--api-key", "k"])
    assert (engine.model, engine.ctx_size, engine.parallel, engine.batch_size, engine.ubatch_size) == \
        ("x", 8192, 4, 512, 64)
    assert (engine.threads, engine.dtype, engine.kv_unified, engine.cache_type, engine.cache_type_v) == \
        (2, "bf16", True, "q8_0", "f16")
    assert engine.ctx_per_slot == 8192
    assert (settings.host, settings.port, settings.alias, settings.api_key) == ("127.0.0.1", 8080, "a", "k")


@pytest.mark.parametrize("argv,message", [
    (["-np", "0"], "--parallel='0': must be an integer >= 1"),
    (["--port", "0"], "--port='0': must be an integer in [1, 65535]"),
    (["--dtype", "nosuch"], "--dtype='nosuch': must be one of f32, bf16, int8, q4_0, q4_1, q5_0, q8_0, auto"),
    (["-ctk", "q4"], "--cache-type-k='q4': must be one of f32, f16, bf16, q8_0"),
    (["--spec-draft-p-min", "nan"], "--spec-draft-p-min='nan': must be a number in [0, 1]"),
    (["-c", "4k"], "--ctx-size='4k': must be an integer >= 1"),
    (["--ctx-size"], "argument -c/--ctx-size: expected one argument"),
    (["--devices", "cpu,gpu0"], "--devices='cpu,gpu0': must be a comma list of devices, each cpu, cuda or cuda:N"),
])
def test_a_bad_flag_is_one_message_naming_flag_value_and_rule(argv, message):
    with pytest.raises(FlagError) as e:
        parse_flags(argv)
    assert str(e.value) == message


def test_a_combination_of_flags_is_the_engines_to_refuse():
    # A draft model needs -md; an MTP draft may be the model's own layers (checked with its headers).
    with pytest.raises(ConfigError, match="spec_draft_model=None: is required with spec_type=draft-simple"):
        parse(["-m", "x", "--spec-type", "draft"])


def test_the_flag_parser_imports_no_torch_and_no_engine_model_code():
    allowed = ("engine", "engine.settings", "engine.errors", "engine.placement", "engine.threads", "engine.cpu")
    code = ("import sys, server.flags; bad = [m for m in sys.modules if m == 'torch' or "
            f"(m.split('.')[0] == 'engine' and m not in {allowed!r})]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=60)


def test_the_engines_torch_types_are_keyed_by_the_names_the_flags_accept():
    assert {d: compute_dtype(d) for d in DTYPES} == {**{d: torch.float32 for d in DTYPES}, "bf16": torch.bfloat16}
    assert tuple(KV_DTYPES) == KV_CACHE_TYPES
    assert set(BLOCK_DTYPES) == {"auto", *blocks.FORMATS}  # the dtypes that keep a file's blocks


@pytest.mark.parametrize("argv,types", [
    (["--dtype", "f32"], ("f32", "f32")),
    (["--dtype", "int8"], ("f32", "f32")),  # int8 weights compute in f32
    (["--dtype", "auto"], ("f32", "f32")),  # and so do a GGUF file's blocks
    (["--dtype", "q4_1"], ("f32", "f32")),
    (["--dtype", "bf16"], ("bf16", "bf16")),
    (["--dtype", "bf16", "-ctk", "q8_0"], ("q8_0", "q8_0")),
    (["--dtype", "bf16", "-ctv", "f16"], ("bf16", "f16")),
])
def test_the_kv_cache_holds_the_compute_type_unless_told_otherwise(argv, types):
    """Attention reads the cache in the compute type: a cache in another type is converted every step."""
    engine, _ = parse(["-m", "x", *argv])
    assert engine.kv_types == types


def test_the_default_model_serves_the_product_speculating_on_four_unified_slots():
    engine, _ = parse([])
    assert (engine.model, engine.dtype, engine.parallel, engine.kv_unified) == ("default", "auto", AUTO_PARALLEL, True)
    assert engine.ctx_per_slot == engine.ctx_size  # each request may still use the whole context
    assert (engine.spec.type, engine.spec.draft_model, engine.spec.width) == ("draft-mtp-ngram", str(DEFAULT_DRAFT), 1)
    assert parse(["--spec-draft-width", "3"])[0].spec.width == 3
    assert parse(["-m", "x", "--spec-type", "mtp", "-md", "d"])[0].spec.width == 1
    assert engine.spec.max_batch == 1  # drafts only while one request decodes: more rows cost more on a CPU
    assert parse(["-m", "default"])[0] == engine
    assert parse(["--spec-max-batch", "0"])[0].spec.max_batch == 0
    assert engine.spec.pacing and not parse(["--no-spec-pacing"])[0].spec.pacing  # pauses where drafting loses
    with pytest.raises(FlagError, match="--spec-max-batch"):
        parse_flags(["--spec-max-batch", "-1"])


@pytest.mark.parametrize("argv", [["--spec-type", "none"], ["-m", "x", "--spec-type", "none"],
                                  ["-md", "default", "--spec-type", "none"], ["-m", "x"], ["-m", "x", "-md", "y"]])
def test_spec_type_none_and_another_model_without_spec_type_do_not_speculate(argv):
    assert parse_flags(argv).spec_type in (None, "none")
    assert parse(argv)[0].spec is None


@pytest.mark.parametrize("argv,kind,draft", [
    (["-m", "x", "--spec-type", "mtp", "-md", "default"], "draft-mtp", str(DEFAULT_DRAFT)),
    (["--spec-type", "draft-mtp", "-md", "default"], "draft-mtp", str(DEFAULT_DRAFT)),
    (["--spec-type", "draft-mtp"], "draft-mtp", str(DEFAULT_DRAFT)),  # the default model's draft unless -md says
    (["-md", "other.safetensors"], "draft-mtp-ngram", "other.safetensors"),  # the default model's own drafter
])
def test_md_default_names_the_shipped_draft(argv, kind, draft):
    spec = parse(argv)[0].spec
    assert (spec.type, spec.draft_model) == (kind, draft)


@pytest.mark.parametrize("argv,slots,unified", [(["-np", "2"], 2, False), (["-np", "2", "--kv-unified"], 2, True),
                                                (["-np", "1"], 1, False), (["--kv-unified"], AUTO_PARALLEL, True)])
def test_an_explicit_np_splits_the_context_unless_kv_unified(argv, slots, unified):
    engine, _ = parse(["-m", "x", "-c", "4096", *argv])
    assert (engine.parallel, engine.kv_unified) == (slots, unified)
    assert engine.ctx_per_slot == (4096 if unified else 4096 // slots)


def test_a_bad_spec_type_lists_none_among_the_choices():
    with pytest.raises(FlagError) as e:
        parse_flags(["--spec-type", "eagle"])
    assert str(e.value) == ("--spec-type='eagle': must be one of draft, draft-mtp, draft-mtp-ngram, draft-simple, mtp, "
                            "mtp-ngram, ngram, ngram-simple, none")


@pytest.mark.parametrize("argv, slots, unified, why", [
    (["-c", "8"], 1, False, "-np auto: 1 slot with the whole context, not 4 sharing one KV pool: a pool needs "
                            "ctx_size >= 16, got 8"),
    (["-b", "2"], 2, True, "-np auto: 2 slot(s), not 4: batch_size=2 holds one row per slot"),
    (["-np", "4"], 4, False, None),
])
def test_the_default_slots_yield_to_the_flags_given_and_say_why(argv, slots, unified, why):
    engine, _ = parse(["-m", "x", *argv])
    assert (engine.parallel, engine.kv_unified) == (slots, unified)
    assert engine.adapted == ((why,) if why else ())


def test_a_qsa_ratio_that_splits_a_page_turns_the_default_pool_into_one_slot_and_is_refused_beside_kv_unified(tmp_path):
    from engine.cli.tiny import tiny_config, write_tiny_model
    from engine.preflight import read_headers
    model = str(write_tiny_model(tiny_config("llama"), tmp_path / "m"))
    qsa = ["-m", model, "--compress-ratios", "all:3", "--qsa-budget", "6"]
    config = read_headers(parse(qsa)[0]).config
    assert (config.parallel, config.kv_unified, config.ctx_per_slot) == (1, False, 4096)
    assert config.adapted == ("-np auto: 1 slot with the whole context, not 4 sharing one KV pool: compress ratio 3 "
                              "does not divide the pool's page of 16 positions",)
    with pytest.raises(ConfigError, match="compress_ratios: ratio 3 must divide the KV page size 16 with kv_unified"):
        read_headers(parse([*qsa, "--kv-unified"])[0])
