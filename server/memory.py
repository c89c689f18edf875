"""Handing freed heap memory back to the operating system after a big request.

A big body (megabytes of JSON, parsed, copied into a model and checked) is freed when its request
ends, but glibc's malloc keeps freed memory in its arenas, and the process's resident size stays
up by hundreds of MB after a few such requests. malloc_trim(0) returns it; other C libraries
(musl, macOS) have no such call and keep their own policy."""
from __future__ import annotations

import ctypes
import ctypes.util

BIG_BODY = 2**20  # bytes: bodies past this are worth a trim when their request ends


def _malloc_trim():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


_trim = _malloc_trim()


def give_back_freed_memory() -> None:
    if _trim is not None:
        _trim(0)
