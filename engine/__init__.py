"""tandem's engine: what server/, train/ and bench/ use of it, by name.

    from engine import Engine, EngineConfig, SpecConfig, SamplingParams

The names load lazily (PEP 562), so importing a torch-free module of the package, such as
engine.settings or engine.placement for a flag check, does not load torch. The layout and the
allowed imports between the subpackages are in docs/architecture.md ("Inside engine/").
"""
from __future__ import annotations

import importlib

_EXPORTS = {
    "Engine": "engine.engine",
    "StepResult": "engine.forward",
    "EngineConfig": "engine.settings",
    "SpecConfig": "engine.settings",
    "DraftLimits": "engine.settings",
    "CompressRatios": "engine.settings",
    "SamplingParams": "engine.sched.sampling",
    "Constraint": "engine.sched.grammar",
    "GrammarError": "engine.sched.grammar",
    "GrammarSpec": "engine.sched.grammar",
    "Request": "engine.sched.request",
    "StepOutput": "engine.sched.request",
    "RequestTimes": "engine.sched.request",
    "ProbeSpec": "engine.model.probe",
    "LayerProbe": "engine.model.probe",
    "Window": "engine.model.probe",
    "Tokenizer": "engine.files.tokenizer",
    "IncrementalDecoder": "engine.files.tokenizer",
    "Headers": "engine.preflight",
    "read_headers": "engine.preflight",
    "SlotInfo": "engine.stats",
    "EngineStats": "engine.stats",
    "TandemError": "engine.errors",
    "ConfigError": "engine.errors",
    "WeightsError": "engine.errors",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
