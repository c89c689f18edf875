"""The controller's effects on the real world: server processes, ports, health checks, timers.

Each method returns at once; the work runs in a task that posts its outcome back to the controller
as an event. A failed load leaves nothing running: whatever it started is stopped before LoadDone.
"""
from __future__ import annotations

import asyncio
import logging
import socket
from pathlib import Path
from typing import Callable

import httpx

from proxy import events as ev
from proxy.children import ChildRegistry
from proxy.config import Profile, flag_value
from proxy.cores import CorePlan
from proxy.jobs import Job
from proxy.logbus import LogBus
from proxy.process import ServerProcess, exit_reason
from proxy.router import Lease, Replica

log = logging.getLogger("tandem.proxy")
HEALTH_POLL_S = 0.1
CPU_FLAGS = ("-C", "--cpu-mask", "-Cr", "--cpu-range")


class LoadError(Exception):
    """Why a replica could not be brought up, as one sentence."""


def unused_port(taken: set[int]) -> int:
    """A port the kernel calls free that is not in `taken`: the ports of our own servers, which a
    server still starting has been given but may not have bound yet."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in taken:
            return port


def check_props(profile: Profile, props: dict) -> list[str]:
    """Where the server's /props disagrees with the profile (only what the profile states)."""
    wrong = []
    if props.get("model_alias") != profile.name:
        wrong.append(f"model_alias is {props.get('model_alias')!r}, expected {profile.name!r}")
    path, model = str(props.get("model_path", "")), profile.model
    if model != "default" and path != model and Path(path).resolve() != Path(model).resolve():
        wrong.append(f"model_path is {path!r}, the profile says {model!r}")
    for key, want in (("n_ctx", profile.ctx_size), ("total_slots", profile.parallel)):
        if want is not None and props.get(key) != want:
            wrong.append(f"{key} is {props.get(key)}, the profile says {want}")
    if not isinstance(props.get("total_slots"), int) or props["total_slots"] < 1:
        wrong.append(f"total_slots is {props.get('total_slots')!r}, expected a positive integer")
    return wrong


class Supervisor:
    def __init__(self, post: Callable[[object], None], children: ChildRegistry, bus: LogBus, log_dir: Path,
                 tail_lines: int = 20, cores: CorePlan | None = None):
        """cores: the split of CPUs among the replicas (None: they run wherever the kernel puts them)."""
        self.post, self.children, self.bus, self.log_dir, self.tail_lines = post, children, bus, log_dir, tail_lines
        self.cores = cores
        self.http = httpx.AsyncClient(timeout=httpx.Timeout(5.0))
        self.processes: dict[int, ServerProcess] = {}  # every live server, by pid
        self.loads: dict[str, asyncio.Task] = {}  # the attempt of each running load, by job id
        self.tasks: set[asyncio.Task] = set()

    def _spawn_task(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- Effects ------------------------------------------------------------------------------------

    def start_load(self, job: Job, profile: Profile, indices: list[int]) -> None:
        self._spawn_task(self._load(job, profile, indices))

    def cancel_load(self, job_id: str) -> None:
        attempt = self.loads.get(job_id)
        if attempt is not None:
            attempt.cancel()

    def stop_replicas(self, model: str, job_id: str | None, replicas: list[Replica], grace: float) -> None:
        self._spawn_task(self._stop(model, job_id, replicas, grace))

    def cancel_leases(self, leases: list[Lease], reason: str) -> None:
        for lease in leases:
            lease.cancel(reason)

    def call_later(self, delay: float, event: object) -> None:
        asyncio.get_running_loop().call_later(delay, self.post, event)

    # -- work -----------------------------------------------------------------------------------------

    async def _load(self, job: Job, profile: Profile, indices: list[int]) -> None:
        started: list[ServerProcess] = []
        attempt = asyncio.ensure_future(self._start(job, profile, indices, started))
        self.loads[job.id] = attempt  # cancel_load cancels the attempt, never this task: the cleanup must run
        try:
            replicas = await attempt
        except LoadError as e:
            await asyncio.gather(*(p.stop(profile.stop_grace) for p in started))
            self.post(ev.LoadDone(job.id, profile.name, error=str(e), log_tail=self._tail(started)))
        except asyncio.CancelledError:
            await asyncio.gather(*(p.stop(profile.stop_grace) for p in started))
            self.post(ev.LoadCancelled(job.id, profile.name, [p.pid for p in started], self._tail(started)))
        else:
            self.post(ev.LoadDone(job.id, profile.name, replicas=list(replicas), log_tail=self._tail(started)))
        finally:
            self.loads.pop(job.id, None)

    def _tail(self, started: list[ServerProcess]) -> list[str]:
        return [line for p in started for line in p.tail][-self.tail_lines:]

    async def _start(self, job: Job, profile: Profile, indices: list[int],
                     started: list[ServerProcess]) -> list[ev.StartedReplica]:
        """Starts the servers (each into `started` as soon as it runs) and waits until all are up."""
        for i in indices:
            proc = await self._spawn(job, profile, i)
            started.append(proc)
            self.post(ev.ReplicaStarting(job.id, profile.name, i, proc.port, proc.pid))
        checks = [asyncio.ensure_future(self._bring_up(profile, i, p)) for i, p in zip(indices, started)]
        try:
            return await asyncio.gather(*checks)
        except LoadError:
            for check in checks:  # one replica failing fails the load: stop waiting for the others
                check.cancel()
            raise

    async def _spawn(self, job: Job, profile: Profile, index: int) -> ServerProcess:
        spec = profile.replicas[index]
        port = unused_port({p.port for p in self.processes.values()})
        argv = [*profile.command, *profile.args, *spec.args, "--alias", profile.name,
                "--host", "127.0.0.1", "--port", str(port)]
        log_path = self.log_dir / f"{job.id}.log"

        def on_line(line: str) -> None:
            self.bus.publish("server", line, profile.name, index)

        try:
            proc = await ServerProcess.spawn(argv, {**profile.env, **spec.env}, port, log_path, on_line,
                                             self.tail_lines)
        except OSError as e:
            raise LoadError(f"replica {index}: could not start {argv[0]!r}: {e}") from e
        self.processes[proc.pid] = proc
        self.children.add(proc.pid, profile.name, port)
        log.info("model %s replica %d: started pid %d on port %d: %s", profile.name, index, proc.pid, port,
                 " ".join(argv), extra={"model": profile.name})
        if self.cores is not None and flag_value([*profile.args, *spec.args], CPU_FLAGS) is None:
            self.cores.add(proc.pid)
        self._spawn_task(self._watch(profile.name, proc))
        return proc

    async def _watch(self, model: str, proc: ServerProcess) -> None:
        code = await proc.wait()
        self.processes.pop(proc.pid, None)
        self.children.remove(proc.pid)
        if self.cores is not None:
            self.cores.remove(proc.pid)
        log.info("model %s: server pid %d %s", model, proc.pid, exit_reason(code, ""), extra={"model": model})
        self.post(ev.ReplicaExited(model, proc.pid, code, proc.last_error_line()))

    async def _bring_up(self, profile: Profile, index: int, proc: ServerProcess) -> ev.StartedReplica:
        """Waits for /health 200 (or exit, or the timeout), then checks /props against the profile."""
        base = f"http://127.0.0.1:{proc.port}"
        loop = asyncio.get_running_loop()
        deadline = loop.time() + profile.health_timeout
        while True:
            if proc.returncode is not None:
                await proc.wait()  # the last lines, for the error
                raise LoadError(f"replica {index} "
                                + exit_reason(proc.returncode, proc.last_error_line(), " before it was healthy"))
            try:
                if (await self.http.get(base + "/health", timeout=2.0)).status_code == 200:
                    break
            except httpx.HTTPError:
                pass  # not listening yet
            if loop.time() >= deadline:
                raise LoadError(f"replica {index} did not answer /health with 200 within "
                                f"{profile.health_timeout:g} s")
            await asyncio.sleep(HEALTH_POLL_S)
        try:
            props = (await self.http.get(base + "/props")).json()
        except (httpx.HTTPError, ValueError) as e:
            raise LoadError(f"replica {index}: /props could not be read: {e}") from e
        wrong = check_props(profile, props)
        if wrong:
            raise LoadError(f"replica {index}: /props does not match the profile: {'; '.join(wrong)}")
        args = [*profile.args, *profile.replicas[index].args]
        devices = flag_value(args, ("--devices",)) or {**profile.env, **profile.replicas[index].env}.get(
            "CUDA_VISIBLE_DEVICES")
        return ev.StartedReplica(index, proc.port, proc.pid, props["total_slots"], devices, proc)

    async def _stop(self, model: str, job_id: str | None, replicas: list[Replica], grace: float) -> None:
        await asyncio.gather(*(r.handle.stop(grace) for r in replicas if r.handle is not None))
        self.post(ev.StopDone(model, job_id, replicas))

    async def shutdown(self, grace: float = 10.0) -> None:
        """Stops every server this proxy started (at proxy exit)."""
        await asyncio.gather(*(p.stop(grace) for p in list(self.processes.values())))
        for task in list(self.tasks):
            task.cancel()
        await self.http.aclose()
