"""CoreShare (engine/threads.py): the engine steps with the cores that other processes leave it,
within 1 .. its most, giving a thread up when two looks agree and taking it back at the first;
idle spells are not looked at; the CPU flags' parsing; pinning."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from engine import threads
from engine.threads import CoreShare, describe_cpus, parse_cpu_mask, parse_cpu_range, pin


@pytest.fixture
def host(monkeypatch):
    """A host of two CPUs whose busy ticks and this process's ticks the test sets."""
    ticks = {"busy": 0, "own": 0}
    monkeypatch.setattr(threads, "_busy_ticks", lambda cpus: ticks["busy"])
    monkeypatch.setattr(threads, "cpu_ticks", lambda pid: ticks["own"])
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(threads, "_TICKS", 100)
    return ticks


def looks(share: CoreShare, host: dict, current: int, others: float, own: float, times: int) -> list[int]:
    """`times` looks, INTERVAL apart, while others keep `others` cores busy and this process `own`."""
    seen = []
    for _ in range(times):
        ticks = 100 * threads.INTERVAL
        host["busy"] += int((others + own) * ticks)
        host["own"] += int(own * ticks)
        host["now"] = host.get("now", 0.0) + threads.INTERVAL
        current = share.threads(current, now=host["now"])
        seen.append(current)
    return seen


def test_a_busy_neighbour_takes_a_thread_after_two_looks_and_gives_it_back(host):
    share = CoreShare(most=2)
    assert looks(share, host, 2, others=0.0, own=2.0, times=3) == [2, 2, 2]  # alone: all its cores
    assert looks(share, host, 2, others=1.0, own=1.0, times=3) == [2, 1, 1]  # one look is not enough; two agree
    assert looks(share, host, 1, others=0.0, own=1.0, times=3) == [2, 2, 2]  # back at the first look


def test_idle_spells_are_not_looked_at_and_keep_the_count(host):
    share = CoreShare(most=2)
    assert looks(share, host, 2, others=1.0, own=1.0, times=3)[-1] == 1
    share.rest()  # idle while the neighbour goes on, or another server takes its turn: no look
    host["now"] += 10
    assert looks(share, host, 1, others=1.0, own=1.0, times=2) == [1, 1]  # met with one thread at once


def test_a_light_neighbour_leaves_the_threads_in_place(host):
    # A client streaming from the same host: half a core, in bursts.
    assert looks(CoreShare(most=2), host, 2, others=0.6, own=1.4, times=4) == [2, 2, 2, 2]


def test_never_below_one_thread_nor_above_its_most(host):
    share = CoreShare(most=1)
    assert looks(share, host, 1, others=0.0, own=1.0, times=4)[-1] == 1
    share = CoreShare(most=2)
    assert looks(share, host, 2, others=2.0, own=0.2, times=4)[-1] == 1


def test_cpu_flags_read_as_llama_server_reads_them():
    assert parse_cpu_range("0-3") == {0, 1, 2, 3} and parse_cpu_range("5") == {5}
    assert parse_cpu_mask("0x5") == {0, 2} and parse_cpu_mask("3") == {0, 1}
    for bad, rule in [("3-1", "lo <= hi"), ("a-b", "lo-hi"), ("-1", "lo-hi")]:
        with pytest.raises(ValueError, match=rule):
            parse_cpu_range(bad)
    with pytest.raises(ValueError, match="at least one CPU"):
        parse_cpu_mask("0")
    assert describe_cpus({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"


def test_pin_moves_every_thread_of_a_process():
    cpu = min(os.sched_getaffinity(0))
    code = ("import threading, time\n"
            "[threading.Thread(target=time.sleep, args=(30,), daemon=True).start() for _ in range(3)]\n"
            "print('up', flush=True)\ntime.sleep(30)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "up"
        pin(child.pid, {cpu})
        tids = os.listdir(f"/proc/{child.pid}/task")
        assert len(tids) == 4 and all(os.sched_getaffinity(int(t)) == {cpu} for t in tids)
    finally:
        child.kill()
        child.wait(timeout=10)
