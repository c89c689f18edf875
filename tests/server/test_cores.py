"""A server shares its host: pinned to two CPUs (-Cr), it steps with one thread while another
process keeps one of them busy and with two again once that stops, serving all the while; /props
says how many. CPUs it may not use are refused by name."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bench.processes import BusyLoops, wait_until


def threads(server) -> int:
    with server.client() as c:
        return c.get("/props").json()["threads"]


def test_a_busy_neighbour_on_its_cores_takes_a_thread_and_gives_it_back(start_server, tiny_model):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs to share")
    server = start_server(["-m", str(tiny_model), "-c", "256", "-t", "2", "-Cr", f"{cpus[0]}-{cpus[1]}"])
    assert threads(server) == 2
    with BusyLoops(1, cpus={cpus[0]}):
        wait_until(lambda: threads(server) == 1, 20, "the server to step with one thread")
        with server.client() as c:
            body = {"prompt": "The river", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            assert c.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 8
    wait_until(lambda: threads(server) == 2, 20, "the server to take its second thread back")


def test_cpus_the_process_may_not_use_are_refused_by_name(tiny_model):
    beyond = max(os.sched_getaffinity(0)) + 1
    done = subprocess.run([sys.executable, "-m", "server", "-m", str(tiny_model), "-Cr", f"{beyond}-{beyond + 1}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"--cpu-mask/--cpu-range: CPU(s) {beyond}-{beyond + 1} are not among this process's CPUs" in done.stderr
