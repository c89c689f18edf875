"""CoreShare: how many threads the engine steps with, from the cores it may use and what other
processes keep busy on them.

A step is a few hundred parallel regions, each ending at a barrier where every thread waits for
the slowest. With as many threads as cores and one other busy process (a build, a second replica,
even at nice 19 when the kernel groups processes by session), one of the threads is off its core
at most barriers, and a region that takes microseconds waits out a scheduler time slice: int8 TG
fell from 75.9 to 1.2 tok/s. With one thread fewer there is no one to wait for. So the thread count
follows the cores of the process's affinity (which the proxy may change while it runs) less those
others kept busy over the last interval, within 1 .. `most` (the server's -t, if given). The
kernels' results do not depend on the thread count (each output element is one thread's), nor do
torch's matrix products here, so the tokens stay the same.
"""
from __future__ import annotations

import os
import time
from pathlib import Path

# Seconds between looks at /proc while the engine has work: a busy neighbour is noticed within
# two of them (reading /proc takes about 0.1 ms).
INTERVAL = 0.25
# Others' use of a core below this fraction leaves its thread in place: a client streaming from the
# same host takes 0.3-0.6 of a core in bursts, and a thread given up for it cost a third of TG
# (main command 124.7 tok/s against 165.6), while a busy loop takes a whole core.
KEEP_BELOW = 0.7
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _busy_ticks(cpus: set[int]) -> int | None:
    """Ticks the given CPUs have spent busy since boot, from /proc/stat (None: not Linux)."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    total = 0
    for line in lines:
        name, *fields = line.split()
        if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(f) for f in fields[:8])
            total += user + nice + system + irq + softirq + steal
    return total


def stat_fields(pid: int | str) -> list[str] | None:
    """The fields of /proc/PID/stat after the command name (which may hold spaces and parentheses):
    fields[0] is the state, fields[i] field i + 3 of the line. None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def cpu_ticks(pid: int | str) -> int | None:
    """Ticks a process's threads have run, user and system (utime and stime); None when it is gone."""
    fields = stat_fields(pid)
    return None if fields is None else int(fields[11]) + int(fields[12])


class CoreShare:
    """Looks only while the engine has work: idle, its threads cost nothing, and what others do
    meanwhile (another server taking its turn) says nothing about the next request. The count
    carries over an idle spell, so a neighbour that stays busy is met with one thread at once."""

    def __init__(self, most: int | None):
        """most: the most threads (the server's -t); None: as many as the affinity's CPUs."""
        self.most = most
        self._last: tuple[float, int, int] | None = None  # (when, busy ticks, own ticks)
        self._pending: int | None = None

    def rest(self) -> None:
        """The engine has nothing to do: the next look starts afresh."""
        self._last = self._pending = None

    def threads(self, current: int, now: float | None = None) -> int:
        """The thread count to step with from now on. Fewer threads once two looks in a row agree
        (one look at a short interval is noisy); more at the first look that allows them (a thread
        short costs half the speed, a thread too many only while the neighbour stays)."""
        now = time.monotonic() if now is None else now
        if self._last is not None and now - self._last[0] < INTERVAL:
            return current
        cpus = os.sched_getaffinity(0)
        busy, own = _busy_ticks(cpus), cpu_ticks("self")
        last, self._last = self._last, (now, busy, own)
        if busy is None or last is None:
            return current
        others = max(0, (busy - last[1]) - (own - last[2])) / (_TICKS * (now - last[0]))  # in cores
        wanted = max(1, min(self.most or len(cpus), len(cpus) - int(others + 1 - KEEP_BELOW)))
        if wanted >= current:
            self._pending = None
            return wanted
        if self._pending == wanted:
            self._pending = None
            return wanted
        self._pending = wanted
        return current


def parse_cpu_range(text: str) -> frozenset[int]:
    """'lo-hi' (or one CPU, 'n') -> those CPUs, as llama-server's --cpu-range reads it."""
    lo, _, hi = text.partition("-")
    try:
        first, last = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError("must be lo-hi, CPU numbers (e.g. 0-3)") from None
    if not 0 <= first <= last:
        raise ValueError("must be lo-hi with 0 <= lo <= hi")
    return frozenset(range(first, last + 1))


def parse_cpu_mask(text: str) -> frozenset[int]:
    """A hexadecimal mask, bit i for CPU i ('0x3' or '3': CPUs 0 and 1), as llama-server's --cpu-mask."""
    try:
        bits = int(text, 16)
    except ValueError:
        raise ValueError("must be a hexadecimal mask (e.g. 0x3 for CPUs 0 and 1)") from None
    if bits <= 0:
        raise ValueError("must name at least one CPU")
    return frozenset(i for i in range(bits.bit_length()) if bits >> i & 1)


def describe_cpus(cpus) -> str:
    """{0, 1, 2, 5} -> '0-2,5'."""
    runs, ordered = [], sorted(cpus)
    for cpu in ordered:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def pin(pid: int, cpus) -> None:
    """Every thread of process pid onto `cpus` (sched_setaffinity moves one thread; threads started
    later inherit their creator's). Threads that end meanwhile are skipped."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, cpus)
        except (ProcessLookupError, FileNotFoundError):
            pass
