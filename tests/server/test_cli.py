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
