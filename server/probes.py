"""`attention_probe` on the wire: the request field as an engine.probe.ProbeSpec, and a request's
probe result as the JSON under `attention_probe` in its response (docs/architecture.md,
"Attention probes")."""
from __future__ import annotations

import base64

import torch

from engine import LayerProbe, ProbeSpec, Window
from server.protocol import AttentionProbe


def probe_spec(wire: AttentionProbe) -> ProbeSpec:
    """Raises engine.errors.ConfigError naming the field for a rule of the engine's (limits, kinds)."""
    query = Window(wire.query["last"]) if isinstance(wire.query, dict) else wire.query
    return ProbeSpec(tuple(wire.layers), wire.kind, query, wire.group, wire.reduce)


def probe_body(spec: ProbeSpec, layers: list[LayerProbe]) -> dict:
    """Per layer its values (head_mean: nested lists; qk: q and k as base64 little-endian f32 with
    shape and dtype beside), the query positions and the key positions [start, stop) covered."""
    out = []
    for r in layers:
        entry = {"layer": r.layer, "query_positions": r.query_positions,
                 "key_positions": [r.key_positions.start, r.key_positions.stop]}
        if spec.kind == "qk":
            entry.update({name: _packed(r.tensors[name]) for name in ("q", "k")})
        else:
            values = r.tensors["values"]
            entry.update(shape=list(values.shape), values=values.tolist(), sparse=r.sparse)
        out.append(entry)
    query = {"last": spec.query.last} if isinstance(spec.query, Window) else spec.query
    head_mean = {"group": spec.group, "reduce": spec.reduce} if spec.kind == "head_mean" else {}
    return {"kind": spec.kind, "query": query, **head_mean, "layers": out}


def _packed(t: torch.Tensor) -> dict:
    data = t.to(torch.float32).contiguous().numpy().astype("<f4").tobytes()
    return {"shape": list(t.shape), "dtype": "float32", "data": base64.b64encode(data).decode("ascii")}
