"""CorePlan: which CPUs each server replica runs on.

Two replicas busy at once on the same cores each step with a thread per core, and each waits at
every barrier for a thread the other's has pushed off its core (engine/threads.py): both collapse.
So the proxy splits its own CPUs evenly among the replicas it runs, in the order they started, and
moves each replica (every thread of every process in its group, -pp workers included) onto its
share whenever a replica starts or ends. A server steps with as many threads as its share has
CPUs, and follows when its share changes. A replica whose args name its CPUs (-C, -Cr) keeps them
and is left out of the split.
"""
from __future__ import annotations

import logging
import os

from engine.threads import describe_cpus, pin, stat_fields

log = logging.getLogger("tandem.proxy")


def split(cpus: list[int], n: int) -> list[frozenset[int]]:
    """n shares of the CPUs: runs as even as they go, the first ones a CPU longer; with more shares
    than CPUs, share i is CPU i modulo their count."""
    if n > len(cpus):
        return [frozenset({cpus[i % len(cpus)]}) for i in range(n)]
    size, longer = divmod(len(cpus), n)
    shares, at = [], 0
    for i in range(n):
        length = size + (i < longer)
        shares.append(frozenset(cpus[at:at + length]))
        at += length
    return shares


def group_pids(pgid: int) -> list[int]:
    """The processes of process group pgid (a server started in its own session leads one)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := stat_fields(entry)) is not None and int(fields[2]) == pgid:
            found.append(int(entry))
    return found


class CorePlan:
    def __init__(self, cpus=None):
        """cpus: the CPUs to split (default: the proxy's own)."""
        self.cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
        self.members: list[int] = []  # server pids, in the order they started

    def add(self, pid: int) -> None:
        self.members.append(pid)
        self.apply()

    def remove(self, pid: int) -> None:
        if pid in self.members:
            self.members.remove(pid)
            self.apply()

    def shares(self) -> dict[int, frozenset[int]]:
        return dict(zip(self.members, split(self.cpus, len(self.members)))) if self.members else {}

    def apply(self) -> None:
        """Every member onto its share; a process that is gone is skipped."""
        shares = self.shares()
        for pid, cpus in shares.items():
            for member in group_pids(pid) or [pid]:
                try:
                    pin(member, cpus)
                except OSError as e:  # e.g. not allowed: it keeps its CPUs, and says so in the log
                    log.warning("server pid %d: could not move it onto CPUs %s: %s", member, describe_cpus(cpus), e)
        if shares:
            log.info("CPUs per server: %s", ", ".join(f"pid {p} on {describe_cpus(c)}" for p, c in shares.items()))
