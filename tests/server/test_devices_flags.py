"""The placement flags (--devices, --layer-split, --tensor-split, --spec-draft-device and
llama-server's spellings) reach the engine's config; a bad split, a device this machine lacks, a
count that does not match the devices and a model that cannot fit stop `python -m server` before it
listens: exit code 2 and one message naming field, value and rule. A split server says where its
layers sit in /props and in its load log."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.processes import ROOT, free_port
from server.cli import parse
from server.flags import FlagError, parse_flags


@pytest.mark.parametrize("argv", [
    ["--devices", "cpu,cuda:1", "--layer-split", "20,10", "--spec-draft-device", "cuda"],
    ["-dev", "cpu,cuda:1", "--layer-split", "20,10", "-devd", "cuda:0"],
    ["--device", "cpu,cuda:1", "--layer-split", "20, 10", "--device-draft", "cuda:0"],
])
def test_llama_server_spellings_map_onto_the_placement(argv):
    engine, _ = parse(argv)
    assert (engine.devices, engine.layer_split, engine.tensor_split, engine.draft_device) == \
        (("cpu", "cuda:1"), (20, 10), None, "cuda:0")


def test_tensor_split_is_kept_as_proportions_until_the_layer_count_is_known():
    engine, _ = parse(["-dev", "cuda:0,cuda:1", "-ts", "3,1.5"])
    assert engine.tensor_split == (3.0, 1.5) and engine.layer_split is None
    assert parse([])[0].devices == ("cpu",)


@pytest.mark.parametrize("argv,message", [
    (["--devices", "cpu,"], "--devices='cpu,': must be a comma list of devices, each cpu, cuda or cuda:N"),
    (["-dev", "cuda:x"], "--devices='cuda:x': must be a comma list of devices, each cpu, cuda or cuda:N"),
    (["--layer-split", "15,0"], "--layer-split='15,0': must be a comma list of layer counts, each an integer >= 1"),
    (["--layer-split", "15.5,14.5"],
     "--layer-split='15.5,14.5': must be a comma list of layer counts, each an integer >= 1"),
    (["-ts", "1,-1"], "--tensor-split='1,-1': must be a comma list of proportions, each a number >= 0, not all 0"),
    (["-ts", "0,0"], "--tensor-split='0,0': must be a comma list of proportions, each a number >= 0, not all 0"),
    (["-devd", "tpu"], "--spec-draft-device='tpu': must be cpu, cuda or cuda:N"),
])
def test_a_malformed_placement_flag_is_one_message(argv, message):
    with pytest.raises(FlagError) as e:
        parse_flags(argv)
    assert str(e.value) == message


def start(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server", "--port", str(free_port()), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def machine_ram_mib() -> int:
    return round(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / 2**20)


CASES = {
    "split sum": (["--devices", "cpu,cpu", "--layer-split", "1,1"],
                  "layer_split='1,1': must sum to the model's 3 trunk layers, not 2"),
    "count mismatch": (["--devices", "cpu,cpu", "--layer-split", "1,1,1"],
                       "layer_split='1,1,1': must give one entry per device (2: cpu,cpu), not 3"),
    "more devices than layers": (["--devices", "cpu,cpu,cpu,cpu"],
                                 "devices='cpu,cpu,cpu,cpu': gives a device no layers of the model's 3 (split "
                                 "1,1,0,1); every device needs at least one"),
    # The test machine has no CUDA (CI has none): a named GPU must be refused, not crash the load.
    "unknown device": (["--devices", "cpu,cuda:0", "--layer-split", "2,1"], "devices='cuda:0': no CUDA device"),
    "unknown draft device": (["-devd", "cuda:1"], "draft_device='cuda:1': no CUDA device"),
    # 2**30 positions of 3 layers x K and V x 2 kv heads x 16 f32 is 768 GiB: more than this machine's RAM.
    "cannot fit": (["-c", str(2**30), "-np", "1"], "ctx_size=1073741824: cpu would need about 786433 MiB (weights 1 MiB + KV "
                                       "cache 786432 MiB at parallel=1) but has {ram} MiB; use a smaller ctx_size"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_placement_the_machine_cannot_serve_exits_2_before_serving(tiny_model, case):
    args, message = CASES[case]
    done = start(["-m", str(tiny_model), *args])
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: {message.format(ram=machine_ram_mib())}")
    assert "listening" not in done.stderr


def test_a_split_server_reports_where_its_layers_sit(start_server, tiny_model):
    server = start_server(["-m", str(tiny_model), "-np", "2", "-c", "512", "-dev", "cpu,cpu", "--layer-split", "1,2"])
    try:
        with server.client() as c:
            props = c.get("/props").json()
            reply = c.post("/v1/completions", json={"prompt": "hello", "max_tokens": 4, "temperature": 0}).json()
        log = server.log_text()
    finally:
        server.kill()
    assert (props["stages"], props["pipeline_depth"], props["draft_device"]) == (2, 1, "cpu")
    [cpu] = props["devices"]
    assert (cpu["device"], cpu["stages"], cpu["layers"], cpu["embedding_copies"]) == ("cpu", [0, 1], [0, 1, 2], 1)
    assert cpu["weight_bytes"] > 0 and cpu["kv_bytes"] > 0
    assert reply["usage"]["completion_tokens"] == 4
    assert "2 stage(s), pipeline depth 1" in log and "device cpu: stages 0,1, layers 0-2" in log
