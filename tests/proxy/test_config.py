"""Profiles are validated at start: every problem of every file at once, with file, profile, field."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.processes import free_port
from proxy.config import ProxyConfigError, load_config

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, proxy: str, **profiles: str) -> Path:
    (tmp_path / "profiles").mkdir()
    for name, text in profiles.items():
        (tmp_path / "profiles" / f"{name}.yaml").write_text(text)
    (tmp_path / "proxy.yaml").write_text(proxy)
    return tmp_path / "proxy.yaml"


def test_shipped_config_is_valid():
    config = load_config(REPO / "configs" / "proxy.yaml")
    assert "smollm2" in config.profiles and config.settings.port == 8082


def test_profile_fields_and_what_the_proxy_reads_from_args(tmp_path):
    path = write(tmp_path, "groups: {g: {exclusive: true}}\n", one="""
m:
  args: [-m, /models/m, --ctx-size=4096, -np, "3", --dtype, bf16]
  replicas: [{args: [--devices, cuda:0]}, {args: [--devices, cuda:1]}]
  restart: on-failure
  group: g
n:
  args: [--model, /models/n]
  restart: no
""")
    config = load_config(path)
    m, n = config.profiles["m"], config.profiles["n"]
    assert (m.model, m.ctx_size, m.parallel, len(m.replicas)) == ("/models/m", 4096, 3, 2)
    assert m.args == ("-m", "/models/m", "--ctx-size=4096", "-np", "3", "--dtype", "bf16")  # untouched
    assert (n.ctx_size, n.parallel, n.restart, n.autoload) == (None, None, "never", False)


def test_all_problems_are_reported_at_once_with_file_profile_and_field(tmp_path):
    path = write(tmp_path, "groups: {}\n", one="""
a:
  args: [-m, x]
  replicaz: 2
b:
  args: [-np, "2"]
  health_timeout: -1
""", two="""
c:
  args: [-m, y, --port, "9000"]
  group: missing
a:
  args: [-m, z]
""")
    with pytest.raises(ProxyConfigError) as info:
        load_config(path)
    text = str(info.value)
    for expected in ("one.yaml: profile 'a': replicaz: unknown key",
                     "one.yaml: profile 'b': args: must name the model with -m/--model",
                     "one.yaml: profile 'b': health_timeout:",
                     "two.yaml: profile 'c': args: --port is set by the proxy",
                     "two.yaml: profile 'c': group: 'missing' is not declared",
                     "two.yaml: profile 'a': already defined in"):
        assert expected in text, text
    assert text.startswith("6 problem(s)")


BAD_DTYPE = "smollm2: {args: [-m, default, -np, '2', --dtype, nosuch]}\n"
BAD_DTYPE_MESSAGE = "profile 'smollm2': args: --dtype='nosuch': must be one of f32, bf16, int8, q4_0, q4_1, q5_0, q8_0, auto"


def test_profile_args_are_read_by_the_servers_own_flag_parser(tmp_path):
    path = write(tmp_path, "groups: {}\n", one=BAD_DTYPE, two="""
fine: {args: [-m, x, --spec-type, ngram, --spec-draft-p-min, "0.25"]}
plain: {args: [-m, default, --spec-type, none]}
shipped: {args: [-m, default, --spec-type, draft-mtp, -md, default]}
zero: {args: [-m, x, -c, "0"]}
typo: {args: [-m, x, --ctx-sise, "4096"]}
""")
    with pytest.raises(ProxyConfigError) as info:
        load_config(path)
    problems = str(info.value).splitlines()
    assert problems[0] == "3 problem(s) in the proxy config:"
    assert problems[1:] == [f"{tmp_path}/profiles/one.yaml: {BAD_DTYPE_MESSAGE}",
                            f"{tmp_path}/profiles/two.yaml: profile 'zero': args: --ctx-size='0': "
                            "must be an integer >= 1",
                            f"{tmp_path}/profiles/two.yaml: profile 'typo': args: unrecognized arguments: "
                            "--ctx-sise 4096"]


def test_the_proxy_exits_2_at_start_naming_the_bad_profile_flag(tmp_path):
    path = write(tmp_path, "groups: {}\n", one=BAD_DTYPE)
    run = subprocess.run([sys.executable, "-m", "proxy", "--config", str(path), "--port", str(free_port()),
                          "--state-dir", str(tmp_path / "state")], cwd=REPO, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 2, run.stderr
    assert BAD_DTYPE_MESSAGE in run.stderr and not (tmp_path / "state").exists()


def test_unknown_proxy_setting_is_named(tmp_path):
    path = write(tmp_path, "prot: 1\n", one="a: {args: [-m, x]}\n")
    with pytest.raises(ProxyConfigError, match=r"proxy.yaml: prot: unknown key"):
        load_config(path)


def test_props_are_checked_against_what_the_profile_states():
    from proxy.supervisor import check_props
    from tests.proxy.fakes import profile
    p = profile("m", parallel=2)  # -m /models/m -np 2, no ctx-size
    good = {"model_alias": "m", "model_path": "/models/m", "n_ctx": 4096, "total_slots": 2}
    assert check_props(p, good) == []
    wrong = check_props(p, {**good, "model_path": "/models/other", "total_slots": 4})
    assert wrong == ["model_path is '/models/other', the profile says '/models/m'",
                     "total_slots is 4, the profile says 2"]


def test_the_proxy_never_imports_torch_or_the_engine():
    """Only the engine's torch-free option names, device-list and CPU parsers (through the server's flag
    parser) and its CPU pinning (proxy/cores.py)."""
    allowed = ("engine", "engine.settings", "engine.errors", "engine.placement", "engine.threads", "engine.cpu")
    code = ("import sys, proxy.__main__, proxy.app; bad = [m for m in sys.modules if m == 'torch' or "
            f"(m.split('.')[0] == 'engine' and m not in {allowed!r})]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)
