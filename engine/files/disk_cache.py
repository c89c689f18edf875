"""What tandem keeps between processes about a model file, under ~/.cache/tandem (or
$XDG_CACHE_HOME/tandem): derived once from the file, keyed by its path, size and modification time
(and whatever else the deriving depends on), so a changed file is derived again."""
from __future__ import annotations

import hashlib
import os
from pathlib import Path


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tandem"


def cache_path(kind: str, source: Path, *depends: str) -> Path:
    """Where `kind` derived from `source` (and `depends`) is kept."""
    stat = source.stat()
    key = ":".join([str(source.resolve()), str(stat.st_size), str(stat.st_mtime_ns), *depends])
    return cache_root() / kind / hashlib.sha256(key.encode()).hexdigest()[:16]


def partial_path(target: Path) -> Path:
    """A name to write `target` under before renaming it into place, so that a process starting
    meanwhile never reads half of it; unique to this process."""
    return target.with_name(f"{target.name}.{os.getpid()}.partial")
