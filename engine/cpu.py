"""What this CPU has, read from /proc/cpuinfo without torch: the kernels' build key
(engine/ops/kernels.py) and the checks of settings that need an instruction set (engine/settings.py)."""
from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

# What the kernels' 8-bit activation path is compiled for (engine/ops/csrc/linear.cpp, -march=native):
# VNNI's u8 x s8 dot products and AVX-512's byte ops.
Q8_ACTIVATION_FLAGS = ("avx512f", "avx512bw", "avx512_vnni", "avx512vbmi")


@functools.cache
def flags_line() -> str:
    """The first `flags` line of /proc/cpuinfo (the processor's name where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def has_q8_activations() -> bool:
    return set(Q8_ACTIVATION_FLAGS) <= set(flags_line().split())


# The flags that decide which kernels a host runs (and llama.cpp's): named beside every benchmark figure.
SPEED_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512vbmi", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8",
               "amx_bf16")


@functools.cache
def model_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def describe() -> str:
    """The CPU's name and its speed-relevant flags, e.g. `AMD EPYC (family 26 model 2), 2 CPUs: avx2
    avx512f avx512_vnni ...`: a benchmark table's first line."""
    family = model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "cpu family" and family is None:
                family = value.strip()
            elif key.strip() == "model" and model is None:
                model = value.strip()
    except OSError:
        pass
    have = set(flags_line().split())
    where = f" (family {family} model {model})" if family and model else ""
    flags = " ".join(f for f in SPEED_FLAGS if f in have) or "no AVX2"
    return f"{model_name()}{where}, {len(os.sched_getaffinity(0))} CPUs: {flags}"
