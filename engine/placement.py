"""Where a model's parts run: the trunk's layers in stages, one stage per device, and the draft.

A stage holds consecutive trunk layers on one device; the embedding sits on the first stage's
device, the final norm and lm_head on the last one's (docs/architecture.md, "Devices and stages").

Stdlib only, so the server's flag parser (and the proxy, through it) can check device names and
splits without importing torch. Whether a named device exists is engine/preflight.py's question.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

# "cpu", "cuda" (its device 0) or "cuda:N".
_DEVICE = re.compile(r"cpu|cuda(:\d+)?")


def parse_device(text: str) -> str:
    """One device name, normalised ("cuda" -> "cuda:0"). Raises ValueError with the rule."""
    name = text.strip()
    if not _DEVICE.fullmatch(name):
        raise ValueError("must be cpu, cuda or cuda:N")
    return "cuda:0" if name == "cuda" else name


def is_device_name(name: str) -> bool:
    """Whether `name` is a device as parse_device gives it: cpu or cuda:N."""
    try:
        return parse_device(name) == name
    except ValueError:
        return False


def parse_devices(text: str) -> tuple[str, ...]:
    """A comma list of device names, in stage order. Raises ValueError with the rule."""
    try:
        return tuple(parse_device(part) for part in text.split(","))
    except ValueError:
        raise ValueError("must be a comma list of devices, each cpu, cuda or cuda:N") from None


def parse_layer_split(text: str) -> tuple[int, ...]:
    """A comma list of layer counts, each >= 1. Raises ValueError with the rule."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) >= 1 for p in parts):
        raise ValueError("must be a comma list of layer counts, each an integer >= 1")
    return tuple(int(p) for p in parts)


def parse_proportions(text: str) -> tuple[float, ...]:
    """A comma list of non-negative numbers, not all zero. Raises ValueError with the rule."""
    rule = "must be a comma list of proportions, each a number >= 0, not all 0"
    try:
        values = tuple(float(p) for p in text.split(","))
    except ValueError:
        raise ValueError(rule) from None
    if not all(v >= 0 and v != float("inf") for v in values) or not any(values):
        raise ValueError(rule)
    return values


def split_by_proportions(proportions: tuple[float, ...], num_layers: int) -> tuple[int, ...]:
    """Layers per device in proportion, as llama-server's -ts: device i's share of the layers is its
    proportion over the sum; device i ends at the cumulative boundary num_layers * (p_0 + .. + p_i) /
    total rounded half up, and takes the layers after the boundary before it. So the counts sum to num_layers, no
    boundary is more than half a layer from its exact place, and a proportion of 0 takes no layers."""
    total, running, before, out = sum(proportions), 0.0, 0, []
    for p in proportions:
        running += p
        boundary = int(num_layers * running / total + 0.5)
        out.append(boundary - before)
        before = boundary
    return tuple(out)


@dataclass(frozen=True)
class Placement:
    """One stage per device, in order: stage i holds the next layer_split[i] trunk layers."""
    devices: tuple[str, ...]
    layer_split: tuple[int, ...]
    draft_device: str = "cpu"

    def __post_init__(self) -> None:
        # Callers resolve flags into a placement (resolve, single); a mismatch here is a bug.
        assert len(self.devices) == len(self.layer_split) >= 1 and all(n >= 1 for n in self.layer_split), self

    @classmethod
    def single(cls, num_layers: int, device: str = "cpu") -> "Placement":
        """The whole model, draft included, on one device: one stage."""
        return cls((device,), (num_layers,), device)

    @classmethod
    def resolve(cls, num_layers: int, devices: tuple[str, ...] = ("cpu",), layer_split: tuple[int, ...] | None = None,
                tensor_split: tuple[float, ...] | None = None, draft_device: str = "cpu") -> "Placement":
        """The placement the flags ask for on a trunk of num_layers layers. Raises ValueError naming
        the field (the flag's name, as EngineConfig spells it), its value and the rule it breaks: the
        counts are known only once the model's header has been read."""
        if layer_split is not None and tensor_split is not None:
            raise ValueError(f"tensor_split={_listed(tensor_split)!r}: cannot be given with layer_split")
        for flag, values in (("layer_split", layer_split), ("tensor_split", tensor_split)):
            if values is not None and len(values) != len(devices):
                raise ValueError(f"{flag}={_listed(values)!r}: must give one entry per device "
                                 f"({len(devices)}: {','.join(devices)}), not {len(values)}")
        if layer_split is not None and sum(layer_split) != num_layers:
            raise ValueError(f"layer_split={_listed(layer_split)!r}: must sum to the model's {num_layers} "
                             f"trunk layers, not {sum(layer_split)}")
        if layer_split is None:
            split = split_by_proportions(tensor_split or (1.0,) * len(devices), num_layers)
            if not all(split):
                flag, given = ("tensor_split", tensor_split) if tensor_split else ("devices", devices)
                raise ValueError(f"{flag}={_listed(given)!r}: gives a device no layers of the model's "
                                 f"{num_layers} (split {_listed(split)}); every device needs at least one")
            layer_split = split
        return cls(tuple(devices), tuple(layer_split), draft_device)

    @property
    def num_layers(self) -> int:
        return sum(self.layer_split)

    def stage_ranges(self) -> list[range]:
        """Each stage's trunk layer indices."""
        out, start = [], 0
        for n in self.layer_split:
            out.append(range(start, start + n))
            start += n
        return out

    def first_stage(self) -> "Placement":
        """Stage 0 alone: what a pipeline head builds (engine/pipeline), the other stages being remote."""
        return Placement(self.devices[:1], self.layer_split[:1], self.draft_device)

    def stage_of(self, layer: int) -> int:
        """The stage that holds trunk layer `layer`."""
        return next(i for i, r in enumerate(self.stage_ranges()) if layer in r)

    def layer_devices(self) -> list[str]:
        """Each trunk layer's device, in layer order."""
        return [device for device, n in zip(self.devices, self.layer_split) for _ in range(n)]


def _listed(values) -> str:
    return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in values)
