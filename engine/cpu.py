"""What this CPU has, read from /proc/cpuinfo without torch: the kernels' build key
(engine/ops/kernels.py) and the checks of settings that need an instruction set (engine/settings.py)."""
from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

# What the kernels' 8-bit activation paths are compiled for (engine/ops/csrc/linear.cpp, -march=native):
# VNNI's u8 x s8 dot products and AVX-512's byte ops, for every block format; or AVX2's vpmaddubsw,
# for the 32-weight blocks (there the K-quants keep f32 activations).
Q8_ACTIVATION_FLAGS = ("avx512f", "avx512bw", "avx512_vnni", "avx512vbmi")
Q8_ACTIVATION_FLAGS_AVX2 = ("avx2", "fma", "f16c")


@functools.cache
def _first_processor() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo (`flags`, `model name`, `cpu family`, ...); none
    where there is no such file."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = line.partition(":")
            if not sep:
                if fields:  # the blank line after the first processor
                    break
                continue
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def flags() -> str:
    """The first processor's flags, space-separated (the processor's name where /proc/cpuinfo has none)."""
    return _first_processor().get("flags") or platform.processor()


def has_q8_activations() -> bool:
    have = set(flags().split())
    return set(Q8_ACTIVATION_FLAGS) <= have or set(Q8_ACTIVATION_FLAGS_AVX2) <= have


# The flags that decide which kernels a host runs (and llama.cpp's): named beside every benchmark figure.
SPEED_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512vbmi", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8",
               "amx_bf16")


def describe() -> str:
    """The CPU's name and its speed-relevant flags, e.g. `AMD EPYC (family 26 model 2), 2 CPUs: avx2
    avx512f avx512_vnni ...`: a benchmark table's first line."""
    fields = _first_processor()
    name = fields.get("model name") or platform.processor() or "unknown CPU"
    family, model = fields.get("cpu family"), fields.get("model")
    where = f" (family {family} model {model})" if family and model else ""
    have = set(flags().split())
    speed = " ".join(f for f in SPEED_FLAGS if f in have) or "no AVX2"
    return f"{name}{where}, {len(os.sched_getaffinity(0))} CPUs: {speed}"
