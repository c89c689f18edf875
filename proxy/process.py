"""One server process: started in its own session with a parent-death signal, its merged
stdout/stderr pumped line by line into a log file, the log bus and a short in-memory tail."""
from __future__ import annotations

import asyncio
import os
import re
import signal
from collections import deque
from pathlib import Path
from typing import Callable

from proxy.children import die_with_parent, signal_group

ERROR_LINE = re.compile(r"error|exception|traceback|fatal|killed", re.IGNORECASE)
LOG_PREFIX = re.compile(r"^\d{4}-\d\d-\d\d[ T][\d:.,]+\s+")  # a timestamp says nothing in a job's error


def exit_reason(code: int, last_line: str, when: str = "") -> str:
    """How a server ended, for an error message: 'exited with code 1<when>: <last_line>', or 'was
    killed by signal 9 (SIGKILL)<when>'. A signal is the whole reason: the line a killed server
    happened to print last says nothing of why, and the job's log_tail keeps it anyway."""
    if code < 0:
        try:
            name = f" ({signal.Signals(-code).name})"
        except ValueError:  # a real-time signal has no name
            name = ""
        return f"was killed by signal {-code}{name}{when}"
    return f"exited with code {code}{when}" + (f": {last_line}" if last_line else "")


class ServerProcess:
    def __init__(self, proc: asyncio.subprocess.Process, argv: list[str], port: int, log_path: Path,
                 on_line: Callable[[str], None], tail_lines: int):
        self.proc, self.argv, self.port, self.log_path = proc, argv, port, log_path
        self.tail: deque[str] = deque(maxlen=tail_lines)
        self._on_line = on_line
        self._pump = asyncio.ensure_future(self._read_output())

    @classmethod
    async def spawn(cls, argv: list[str], env: dict[str, str], port: int, log_path: Path,
                    on_line: Callable[[str], None], tail_lines: int = 20) -> "ServerProcess":
        """Raises OSError when the command cannot be started."""
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True,
            preexec_fn=die_with_parent())
        return cls(proc, argv, port, log_path, on_line, tail_lines)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def last_error_line(self) -> str:
        """The server's last line that looks like an error, else its last line."""
        lines = [line for line in self.tail if line.strip()]
        errors = [line for line in lines if ERROR_LINE.search(line)]
        return LOG_PREFIX.sub("", (errors or lines or [""])[-1].strip())

    async def _read_output(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "a", buffering=1, errors="replace") as log_file:
            while True:
                raw = await self.proc.stdout.readline()
                if not raw:
                    break
                line = raw.decode(errors="replace").rstrip("\n")
                log_file.write(line + "\n")
                self.tail.append(line)
                self._on_line(line)

    async def wait(self) -> int:
        """The exit code, once the process has exited and its output is fully read."""
        code = await self.proc.wait()
        try:
            await asyncio.wait_for(asyncio.shield(self._pump), 2.0)
        except asyncio.TimeoutError:  # a helper process still holds the pipe open
            pass
        return code

    async def stop(self, grace: float) -> int:
        """SIGTERM to the process group; SIGKILL if it has not exited after `grace` seconds."""
        if self.proc.returncode is None:
            signal_group(self.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(asyncio.shield(self.proc.wait()), grace)
            except asyncio.TimeoutError:
                signal_group(self.pid, signal.SIGKILL)
        code = await self.proc.wait()
        try:  # helpers the server left behind in its group; never the bare pid, which may be reused now
            os.killpg(self.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return code
