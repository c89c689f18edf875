"""CorePlan (proxy/cores.py): the proxy's CPUs split evenly among the replicas it runs, in the order
they started, every thread of every process of a replica's group moved onto its share."""
from __future__ import annotations

import os
import subprocess
import sys

from proxy.cores import CorePlan, group_pids, split


def test_shares_are_runs_as_even_as_they_go_and_wrap_past_the_cpu_count():
    assert split([0, 1, 2, 3], 1) == [{0, 1, 2, 3}]
    assert split([0, 1, 2, 3, 4], 2) == [{0, 1, 2}, {3, 4}]
    assert split([0, 1], 2) == [{0}, {1}]
    assert split([0, 1], 3) == [{0}, {1}, {0}]


def test_a_replica_and_its_group_move_when_another_starts_and_back_when_it_ends():
    cpus = sorted(os.sched_getaffinity(0))
    # A leader of its own group with a helper in it (as a -pp server's worker), and a second leader.
    code = "import subprocess, sys, time\nsubprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)'])\n" \
           "print('up', flush=True)\ntime.sleep(30)"
    first = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    second = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert first.stdout.readline().strip() == "up" and second.stdout.readline().strip() == "up"
        plan = CorePlan(cpus)
        plan.add(first.pid)
        group = group_pids(first.pid)
        assert len(group) == 2 and all(os.sched_getaffinity(p) == set(cpus) for p in group)
        plan.add(second.pid)
        one, two = split(cpus, 2)
        assert all(os.sched_getaffinity(p) == one for p in group) and os.sched_getaffinity(second.pid) == two
        plan.remove(second.pid)
        assert all(os.sched_getaffinity(p) == set(cpus) for p in group)
    finally:
        for leader in (first, second):
            os.killpg(leader.pid, 9)
            leader.wait(timeout=10)

