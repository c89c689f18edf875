"""A server shares its host: pinned to two CPUs (-Cr), it steps with one thread while another
process keeps one of them busy and with two again once that stops, serving all the while; /props
says how many. CPUs it may not use are refused by name."""
from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import time

import pytest

from bench.processes import BusyLoops


def threads(server) -> int:
    with server.client() as c:
        return c.get("/props").json()["threads"]


def threads_while_busy(server) -> set[int]:
    """The thread counts /props gives while the server generates a long answer (it looks at its
    neighbours only while it has work)."""
    seen = set()
    with concurrent.futures.ThreadPoolExecutor(1) as pool, server.client() as c:
        body = {"prompt": "The river", "max_tokens": 4000, "temperature": 0, "ignore_eos": True}
        answer = pool.submit(c.post, "/v1/completions", json=body, timeout=120)
        while not answer.done():
            seen.add(threads(server))
            time.sleep(0.05)
        assert answer.result().json()["usage"]["completion_tokens"] == 4000
    return seen


@pytest.mark.alone
def test_a_busy_neighbour_on_its_cores_takes_a_thread_and_gives_it_back(start_server, tiny_model):
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs two CPUs to share")
    server = start_server(["-m", str(tiny_model), "-c", "4096", "-np", "1", "-t", "2", "-Cr", f"{cpus[0]}-{cpus[1]}"])
    assert threads(server) == 2
    with BusyLoops(1, cpus={cpus[0]}):
        assert 1 in threads_while_busy(server)  # the answer still completes
        assert threads(server) == 1  # and the count carries over the idle spell
    # Back to two at the first look that finds the core free; a shared host's own bursts may hide
    # it during one answer (seen in 2 of 4 full-suite runs), not during three.
    assert any(2 in threads_while_busy(server) for _ in range(3))


def test_cpus_the_process_may_not_use_are_refused_by_name(tiny_model):
    beyond = max(os.sched_getaffinity(0)) + 1
    done = subprocess.run([sys.executable, "-m", "server", "-m", str(tiny_model), "-Cr", f"{beyond}-{beyond + 1}"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert f"--cpu-mask/--cpu-range: CPU(s) {beyond}-{beyond + 1} are not among this process's CPUs" in done.stderr
