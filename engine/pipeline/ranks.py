"""Who is who in a pipeline, and how its processes start and meet.

Under torchrun every process gets RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT: rank 0 is the
head, ranks 1..N-1 the trunk's other stages, and with --spec-draft-rank one more rank, the last,
runs the draft (engine/pipeline/draft_rank.py). Run alone, the head starts the others itself as child processes of the
same command line with those variables set, so each child finds itself a worker. Children get a
parent-death signal: a head killed outright takes its workers with it. The signal fires when the
thread that started the child exits, so they are started from the main thread, which lives as long
as the process.
"""
from __future__ import annotations

import ctypes
import datetime
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.errors import ConfigError
from engine.pipeline.ports import free_port
from engine.placement import Placement

log = logging.getLogger("tandem.pipeline")

PR_SET_PDEATHSIG = 1
# How long the ranks wait for each other to load their weights and meet (a big model loads slowly).
JOIN_TIMEOUT = datetime.timedelta(minutes=10)
# How long a worker that has exited or been told to stop may take to be gone (a loaded machine is slow).
EXIT_GRACE_S = 2.0


@dataclass(frozen=True)
class Rank:
    rank: int
    world: int
    init_method: str  # where the ranks meet: env:// under torchrun, the head's tcp:// address otherwise
    draft: bool = False  # whether the last rank runs the draft (the others the trunk's stages)

    @property
    def is_head(self) -> bool:
        return self.rank == 0

    @property
    def stages(self) -> int:
        """The ranks of the trunk's ring, 0 .. stages-1."""
        return self.world - int(self.draft)

    @property
    def is_draft(self) -> bool:
        return self.draft and self.rank == self.world - 1


def from_env(stages: int, env=os.environ, draft: bool = False) -> Rank | None:
    """This process's rank when torchrun (or a head) set one, else None. Raises ConfigError when
    the world torchrun made is not the -pp (and --spec-draft-rank) asked for."""
    if "RANK" not in env:
        return None
    world = int(env.get("WORLD_SIZE", "1"))
    if draft and world != stages + 1:
        raise ConfigError(f"pipeline_parallel_size={stages} with spec_draft_rank: must be one less than the "
                          f"WORLD_SIZE={world} the processes were started with (one process per stage, and one for "
                          f"the draft)")
    if not draft and world != stages:
        raise ConfigError(f"pipeline_parallel_size={stages}: must equal the WORLD_SIZE={world} the processes were "
                          f"started with (one process per stage)")
    return Rank(int(env["RANK"]), world, "env://", draft) if world > 1 else None


def _within_grace(done) -> None:
    """Polls `done` until it holds or EXIT_GRACE_S have passed."""
    deadline = time.monotonic() + EXIT_GRACE_S
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)


def _die_with_parent(parent: int) -> None:
    """In the child, before exec: SIGKILL when the parent's spawning thread exits."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)


class LocalWorkers:
    """Ranks 1..N-1 as children of this process: started from the main thread, stopped with it."""

    def __init__(self, argv: list[str], world: int, draft: bool = False):
        port = free_port()
        self.rank = Rank(0, world, f"tcp://127.0.0.1:{port}", draft)
        parent = os.getpid()
        self.procs: dict[int, subprocess.Popen] = {}
        for rank in range(1, world):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port)}
            self.procs[rank] = subprocess.Popen([sys.executable, "-m", "server", *argv], env=env,
                                                preexec_fn=lambda: _die_with_parent(parent))
        log.info("pipeline: started %d worker process(es), pids %s", len(self.procs),
                 ", ".join(str(p.pid) for p in self.procs.values()))

    def describe_loss(self, rank: int, error: Exception) -> str | None:
        """A lost stage named by the worker that exited, when one did. Its sockets close while it
        exits, so the head may hear of it before the process is gone: it gets a moment to be."""
        _within_grace(lambda: self.exited() is not None)
        return self.exited()

    def exited(self) -> str | None:
        """The first worker that has exited, named by stage, or None while all run."""
        for r, proc in self.procs.items():
            code = proc.poll()
            if code is not None:
                how = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
                what = "the draft" if self.rank.draft and r == self.rank.world - 1 else f"pipeline stage {r}"
                return f"{what} (rank {r}, pid {proc.pid}) {how}"
        return None

    def stop(self, timeout: float = 5.0) -> None:
        """A moment to exit by themselves (the head has told them to stop, and a SIGTERM sent at
        once would cut that short), then SIGTERM, then SIGKILL for any still running after
        `timeout` seconds."""
        _within_grace(lambda: all(p.poll() is not None for p in self.procs.values()))
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout)


def join(rank: Rank, placement: Placement) -> torch.device:
    """Meet the other ranks (each calls this once its weights are loaded): nccl when every stage is
    on a CUDA device, else gloo; with a draft rank, gloo for the CPU tensors it exchanges with the
    head beside nccl for the stages' hidden states. Returns the device this rank's ring messages
    travel from: its stage's under nccl, the CPU under gloo (and on the draft rank)."""
    nccl = all(d.startswith("cuda") for d in placement.devices)
    backend = ("cpu:gloo,cuda:nccl" if rank.draft else "nccl") if nccl else "gloo"
    dist.init_process_group(backend, init_method=rank.init_method, rank=rank.rank, world_size=rank.world,
                            timeout=JOIN_TIMEOUT)
    return torch.device(placement.devices[rank.rank] if nccl and not rank.is_draft else "cpu")
