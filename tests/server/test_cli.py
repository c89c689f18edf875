"""llama-server's flag names map onto EngineConfig and ServerSettings; bad combinations fail early."""
import pytest

from engine.errors import ConfigError
from server.cli import parse


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


@pytest.mark.parametrize("argv,word", [
    (["--spec-type", "mtp"], "spec_draft_model=None: is required"),
    (["-np", "0"], "parallel"),
    (["--port", "0"], "port"),
])
def test_bad_flags_are_refused_naming_the_flag(argv, word):
    with pytest.raises(ConfigError, match=word):
        parse(argv)


@pytest.mark.parametrize("argv,types", [
    (["--dtype", "f32"], ("f32", "f32")),
    (["--dtype", "int8"], ("f32", "f32")),  # int8 weights compute in f32
    (["--dtype", "bf16"], ("bf16", "bf16")),
    (["--dtype", "bf16", "-ctk", "q8_0"], ("q8_0", "q8_0")),
    (["--dtype", "bf16", "-ctv", "f16"], ("bf16", "f16")),
])
def test_the_kv_cache_holds_the_compute_type_unless_told_otherwise(argv, types):
    """Attention reads the cache in the compute type: a cache in another type is converted every step."""
    engine, _ = parse(["-m", "x", *argv])
    assert engine.kv_types == types
