"""Server processes must not outlive the proxy, even one killed with SIGKILL.

Two guards: each child asks the kernel for a signal when its parent dies (PR_SET_PDEATHSIG, Linux),
and each child is recorded in SQLite with its start time and command line, so a restarted proxy
stops any recorded child that still runs (the record is checked first, so a reused pid is spared).
"""
from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import signal
import sqlite3
import sys
import time
from dataclasses import dataclass

from engine.threads import stat_fields

log = logging.getLogger("tandem.proxy")

PR_SET_PDEATHSIG = 1
PDEATH_SIGNAL = signal.SIGTERM  # a graceful stop lets a server stop its own helpers
_prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent():
    """A preexec_fn for subprocess: the child gets PDEATH_SIGNAL when this process dies.

    Bound before fork (the child only calls prctl). The parent may already have died between fork
    and prctl; then the child is re-parented and stops itself.
    """
    parent = os.getpid()

    def preexec() -> None:
        if _prctl is not None:
            _prctl(PR_SET_PDEATHSIG, int(PDEATH_SIGNAL), 0, 0, 0)
        if os.getppid() != parent:
            os.kill(os.getpid(), PDEATH_SIGNAL)
    return preexec


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None if it is gone (or a zombie)."""
    fields = stat_fields(pid)
    return None if fields is None or fields[0] == "Z" else int(fields[19])


def cmdline(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [p.decode(errors="replace") for p in f.read().split(b"\0")[:-1]]
    except OSError:
        return None


# How long a new child's command line may stay unreadable after spawn returns.
EXEC_SETTLE_S = 1.0


def settled_cmdline(pid: int) -> list[str] | None:
    """The command line of a child just spawned. spawn returns once the exec has begun (the
    close-on-exec pipe closed), but the kernel fills in the new argv a moment later: read in
    between, it is empty, and a record of that would never match the running child again."""
    deadline = time.monotonic() + EXEC_SETTLE_S
    argv = cmdline(pid)
    while argv == [] and time.monotonic() < deadline:
        time.sleep(0.002)
        argv = cmdline(pid)
    return argv


@dataclass(frozen=True)
class ChildRecord:
    pid: int
    start_ticks: int
    cmdline: list[str]
    model: str
    port: int

    def still_ours(self) -> bool:
        return start_ticks(self.pid) == self.start_ticks and cmdline(self.pid) == self.cmdline


class ChildRegistry:
    """The servers this proxy started and has not yet seen exit."""

    def __init__(self, db: sqlite3.Connection):
        self.db = db
        db.execute("CREATE TABLE IF NOT EXISTS children (pid INTEGER PRIMARY KEY, start_ticks INTEGER NOT NULL, "
                   "cmdline TEXT NOT NULL, model TEXT NOT NULL, port INTEGER NOT NULL)")
        db.commit()

    def add(self, pid: int, model: str, port: int) -> None:
        ticks, argv = start_ticks(pid), settled_cmdline(pid)
        if ticks is None or argv is None:
            return  # already gone: nothing could be left over
        with self.db:
            self.db.execute("INSERT OR REPLACE INTO children VALUES (?, ?, ?, ?, ?)",
                            (pid, ticks, json.dumps(argv), model, port))

    def remove(self, pid: int) -> None:
        with self.db:
            self.db.execute("DELETE FROM children WHERE pid = ?", (pid,))

    def records(self) -> list[ChildRecord]:
        rows = self.db.execute("SELECT pid, start_ticks, cmdline, model, port FROM children").fetchall()
        return [ChildRecord(pid, ticks, json.loads(argv), model, port) for pid, ticks, argv, model, port in rows]


def signal_group(pid: int, sig: int) -> None:
    """Servers lead their own process group (start_new_session), so the group takes their helpers
    too; a process that leads no group gets the signal alone."""
    try:
        os.killpg(pid, sig)
        return
    except (ProcessLookupError, PermissionError):
        pass
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


async def reap_leftovers(registry: ChildRegistry, grace: float = 3.0) -> list[ChildRecord]:
    """Stops recorded children of an earlier proxy process that still run; returns the ones stopped.
    Called once at start, before any new server is started."""
    stopped = []
    for rec in registry.records():
        if rec.still_ours():
            log.warning("stopping leftover server pid %d (model %s, port %d) of an earlier proxy",
                        rec.pid, rec.model, rec.port)
            signal_group(rec.pid, signal.SIGTERM)
            stopped.append(rec)
    deadline = asyncio.get_running_loop().time() + grace
    while any(r.still_ours() for r in stopped) and asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(0.05)
    for rec in stopped:
        if rec.still_ours():
            signal_group(rec.pid, signal.SIGKILL)
    for rec in registry.records():
        registry.remove(rec.pid)
    return stopped
