"""Proxy config and model profiles, validated once when read.

`configs/proxy.yaml` holds the proxy's own settings and the globs of its profile files; each
profile file maps profile names to profiles. Every problem in every file is collected and raised
as one ProxyConfigError naming file, profile and field, so a user fixes them all in one pass.
"""
from __future__ import annotations

import glob
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from server.flags import parse_flags
from server.protocol import validation_problems

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]*$")  # no '/': names appear in /upstream/{model}/...
OWNED_FLAGS = ("--alias", "--host", "--port")  # the proxy sets these on every server it starts
MODEL_FLAGS, CTX_FLAGS, PARALLEL_FLAGS = ("-m", "--model"), ("-c", "--ctx-size"), ("-np", "--parallel")


class ProxyConfigError(Exception):
    """One or more config problems; the message lists each on its own line."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ReplicaSpec(_Strict):
    """One server process of a profile; its args are appended to the profile's (e.g. devices)."""
    args: tuple[str, ...] = ()
    env: dict[str, str] = Field(default_factory=dict)


class Profile(_Strict):
    name: str
    args: tuple[str, ...]
    command: tuple[str, ...] = (sys.executable, "-m", "server")
    env: dict[str, str] = Field(default_factory=dict)
    replicas: tuple[ReplicaSpec, ...] = (ReplicaSpec(),)
    health_timeout: float = Field(default=120.0, gt=0)
    drain_timeout: float = Field(default=60.0, ge=0)  # as the server's --drain-timeout
    stop_grace: float = Field(default=10.0, ge=0)  # SIGTERM -> SIGKILL
    autoload: bool = False
    ttl: float = Field(default=0.0, ge=0)  # idle seconds before an automatic unload; 0: never
    restart: Literal["never", "on-failure"] = "never"
    restart_limit: int = Field(default=3, ge=0)
    group: str | None = None
    queue_limit: int | None = Field(default=None, ge=0)  # waiting requests; None: the proxy's default

    @field_validator("replicas", mode="before")
    @classmethod
    def _replica_count(cls, v: Any) -> Any:
        if isinstance(v, int) and not isinstance(v, bool):
            if v < 1:
                raise ValueError("must be >= 1 (or a list of replicas)")
            return [{}] * v
        return v

    @field_validator("replicas")
    @classmethod
    def _some_replicas(cls, v: tuple[ReplicaSpec, ...]) -> tuple[ReplicaSpec, ...]:
        if not v:
            raise ValueError("must list at least one replica")
        for i, r in enumerate(v):
            _check_owned(r.args, f"replicas[{i}].args")
        return v

    @field_validator("restart", mode="before")
    @classmethod
    def _yaml_no(cls, v: Any) -> Any:
        return "never" if v is False else v  # YAML reads a bare `no` as false

    @field_validator("args")
    @classmethod
    def _args(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        _check_owned(v, "args")
        if flag_value(v, MODEL_FLAGS) is None:
            raise ValueError("must name the model with -m/--model")
        parse_flags(v)  # the server's own parser, so a bad value fails here and not at a load; a ValueError
        return v

    @property
    def model(self) -> str:
        return flag_value(self.args, MODEL_FLAGS)

    @property
    def ctx_size(self) -> int | None:
        value = flag_value(self.args, CTX_FLAGS)
        return int(value) if value is not None else None

    @property
    def parallel(self) -> int | None:
        value = flag_value(self.args, PARALLEL_FLAGS)
        return int(value) if value is not None else None


class GroupSpec(_Strict):
    exclusive: bool = False


class ProxySettings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8082, ge=1, le=65535)
    state_dir: str = "~/.local/state/tandem-proxy"
    api_key: str | None = None
    profiles: tuple[str, ...] = ("profiles/*.yaml",)  # globs, relative to the config file
    groups: dict[str, GroupSpec] = Field(default_factory=dict)
    queue_limit: int = Field(default=64, ge=0)
    log_tail_lines: int = Field(default=20, ge=1)
    # Split the proxy's CPUs among the replicas it runs (proxy/cores.py); a replica whose args say
    # -C or -Cr keeps those.
    pin_cpus: bool = True
    # Seconds the models' requests get to finish when the proxy is stopped (SIGTERM, SIGINT); None:
    # each profile's drain_timeout, as an unload gives them.
    shutdown_drain_timeout: float | None = Field(default=None, ge=0)


@dataclass(frozen=True)
class ProxyConfig:
    settings: ProxySettings
    profiles: dict[str, Profile]
    path: Path

    @property
    def state_dir(self) -> Path:
        return Path(os.path.expanduser(self.settings.state_dir))

    def queue_limit(self, profile: Profile) -> int:
        return profile.queue_limit if profile.queue_limit is not None else self.settings.queue_limit


def flag_value(args: tuple[str, ...] | list[str], flags: tuple[str, ...]) -> str | None:
    """The value of the last of `flags` in a server command line (`-c 4096` or `--ctx-size=4096`)."""
    value = None
    for i, a in enumerate(args):
        if a in flags and i + 1 < len(args):
            value = args[i + 1]
        elif "=" in a and a.split("=", 1)[0] in flags:
            value = a.split("=", 1)[1]
    return value


def _check_owned(args: tuple[str, ...], where: str) -> None:
    for a in args:
        if a.split("=", 1)[0] in OWNED_FLAGS:
            raise ValueError(f"{a.split('=', 1)[0]} is set by the proxy; remove it from {where}")


def _read_yaml(path: Path, errors: list[str]) -> Any:
    try:
        return yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as e:
        errors.append(f"{path}: cannot read: {e}")
        return None


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> ProxyConfig:
    """Reads proxy.yaml and every profile file it names; raises one ProxyConfigError listing all problems."""
    path = Path(path).resolve()
    errors: list[str] = []
    raw = _read_yaml(path, errors)
    if raw is None:
        raise ProxyConfigError(errors[0])
    if not isinstance(raw, dict):
        raise ProxyConfigError(f"{path}: must be a mapping of settings")
    try:
        settings = ProxySettings(**{**raw, **(overrides or {})})
    except ValidationError as e:
        raise ProxyConfigError("\n".join(f"{path}: {m}" for m in validation_problems(e.errors()))) from e

    profiles: dict[str, Profile] = {}
    origin: dict[str, Path] = {}
    files = [Path(f) for pattern in settings.profiles
             for f in sorted(glob.glob(str(path.parent / os.path.expanduser(pattern))))]
    if not files:
        errors.append(f"{path}: profiles: no file matches {list(settings.profiles)}")
    for file in files:
        data = _read_yaml(file, errors)
        if data is None:
            continue
        if not isinstance(data, dict):
            errors.append(f"{file}: must map profile names to profiles")
            continue
        for name, body in data.items():
            where = f"{file}: profile {name!r}"
            if not isinstance(name, str) or not NAME_RE.match(name):
                errors.append(f"{where}: name must match {NAME_RE.pattern}")
                continue
            if name in origin:
                errors.append(f"{where}: already defined in {origin[name]}")
                continue
            origin[name] = file
            if not isinstance(body, dict):
                errors.append(f"{where}: must be a mapping of fields")
                continue
            if "name" in body:
                errors.append(f"{where}: name: unknown key (a profile's name is its key in the file)")
                continue
            group = body.get("group")
            if isinstance(group, str) and group not in settings.groups:
                errors.append(f"{where}: group: {group!r} is not declared under `groups` in {path}")
            try:
                profiles[name] = Profile(**{**body, "name": name})
            except ValidationError as e:
                errors += [f"{where}: {m}" for m in validation_problems(e.errors())]
    if errors:
        raise ProxyConfigError(f"{len(errors)} problem(s) in the proxy config:\n" + "\n".join(errors))
    return ProxyConfig(settings=settings, profiles=profiles, path=path)
