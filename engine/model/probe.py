"""Attention probes: for a few chosen layers of one request, the attention its prompt's queries pay
to the prompt's keys (averaged over heads, then over groups of positions), or the post-RoPE Q and K
themselves (docs/architecture.md, "Attention probes").

`ProbeSpec` is what a caller asks for, checked once; `ProbeCapture` is one request's probe while
its prompt runs: the model hands it, layer by layer and chunk by chunk, the q of the chosen layers'
rows and the slot's keys, and it keeps only what the result needs.

The command line is engine/cli/probe.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.errors import check_rules

KINDS = ("head_mean", "qk")
REDUCES = ("mean", "none")
MAX_LAYERS = 8  # layers one probe may name
# Query positions whose q a probe keeps ("all", {"last": w}) and prompt positions kind "qk" returns:
# a head_mean probe holds [positions, kv_heads, prompt] f32 per layer until the prompt ends.
MAX_POSITIONS = 1024


@dataclass(frozen=True)
class Window:
    """The last `last` prompt positions (SnapKV's observation window): their weights averaged."""
    last: int


Query = str | int | Window  # "last", "all", an index (negative: from the end) or a Window


@dataclass(frozen=True)
class ProbeSpec:
    """What one request asks to see. `group` and `reduce` belong to kind "head_mean" (defaults 1
    and "mean"); kind "qk" takes neither."""
    layers: tuple[int, ...]  # trunk layer indices; negative ones count from the last
    kind: str = "head_mean"
    query: Query = "last"
    group: int | None = None
    reduce: str | None = None

    def __post_init__(self) -> None:
        q = self.query
        head_mean = self.kind == "head_mean"
        check_rules([
            (0 < len(self.layers) <= MAX_LAYERS, "attention_probe.layers", list(self.layers),
             f"must name 1 to {MAX_LAYERS} layers"),
            (self.kind in KINDS, "attention_probe.kind", self.kind, f"must be one of {', '.join(KINDS)}"),
            (q in ("last", "all") or (isinstance(q, int) and not isinstance(q, bool)) or isinstance(q, Window),
             "attention_probe.query", q, 'must be "last", "all", a prompt index or {"last": w}'),
            (not isinstance(q, Window) or 1 <= q.last <= MAX_POSITIONS, "attention_probe.query.last",
             getattr(q, "last", None), f"must be in [1, {MAX_POSITIONS}]"),
            (head_mean or self.group is None, "attention_probe.group", self.group, 'only for kind "head_mean"'),
            (head_mean or self.reduce is None, "attention_probe.reduce", self.reduce, 'only for kind "head_mean"'),
            (self.group is None or self.group >= 1, "attention_probe.group", self.group, "must be >= 1"),
            (self.reduce is None or self.reduce in REDUCES, "attention_probe.reduce", self.reduce,
             f"must be one of {', '.join(REDUCES)}"),
        ])
        if head_mean:
            object.__setattr__(self, "group", self.group or 1)
            object.__setattr__(self, "reduce", self.reduce or "mean")

    @property
    def recomputes(self) -> bool:
        """Whether the probe needs q at prompt positions before the last, so the whole prompt runs
        again (no cached prefix): only the last prompt token is recomputed on reuse."""
        return self.kind == "qk" or self.query != "last"

    def layer_indices(self, num_layers: int) -> tuple[int, ...]:
        """The layers as indices in [0, num_layers); raises ConfigError naming a bad one."""
        check_rules([(-num_layers <= i < num_layers, "attention_probe.layers", i,
                      f"must be in [-{num_layers}, {num_layers}) for this model's {num_layers} layers")
                     for i in self.layers])
        out = tuple(i % num_layers for i in self.layers)
        check_rules([(len(set(out)) == len(out), "attention_probe.layers", list(self.layers),
                      "must name each layer once")])
        return out

    def query_positions(self, n_prompt: int) -> list[int]:
        """The prompt positions whose queries the probe reads; raises ConfigError when the prompt
        is too short for the query, or too long for the limits."""
        q = self.query
        check_rules([
            (not isinstance(q, int) or -n_prompt <= q < n_prompt, "attention_probe.query", q,
             f"must be in [-{n_prompt}, {n_prompt}) for this prompt of {n_prompt} tokens"),
            (not isinstance(q, Window) or q.last <= n_prompt, "attention_probe.query.last",
             getattr(q, "last", None), f"must be at most the prompt's {n_prompt} tokens"),
        ])
        # Every prompt position's Q or weights are kept: the field that asked for them is named.
        whole = ("attention_probe.kind", self.kind) if self.kind == "qk" else ("attention_probe.query", q)
        check_rules([((q != "all" and self.kind != "qk") or n_prompt <= MAX_POSITIONS, *whole,
                     f"needs a prompt of at most {MAX_POSITIONS} tokens (this one has {n_prompt})")])
        if q == "last":
            return [n_prompt - 1]
        if q == "all":
            return list(range(n_prompt))
        if isinstance(q, Window):
            return list(range(n_prompt - q.last, n_prompt))
        return [q % n_prompt]

    def check(self, num_layers: int, n_prompt: int) -> None:
        """Every rule that needs the model or the prompt; raises ConfigError naming the field."""
        self.layer_indices(num_layers)
        self.query_positions(n_prompt)


@dataclass(frozen=True)
class LayerProbe:
    """One layer's result. head_mean: `values` [groups] (reduce "mean") or [kv_heads, groups],
    with a leading [queries] axis after kv_heads for query "all"; qk: `q` [queries, heads, d] and
    `k` [prompt, kv_heads, d]. Keys cover positions key_positions; group g of `group` covers
    key positions g*group .. g*group+group-1 within them."""
    layer: int
    tensors: dict[str, torch.Tensor]
    query_positions: list[int]
    key_positions: range
    sparse: bool  # a QSA layer whose queries attended kept blocks only (past its budget)


@dataclass
class ProbeCapture:
    """One request's probe while its prompt runs, in its resolved layers and query positions."""
    spec: ProbeSpec
    layers: tuple[int, ...]
    positions: list[int]  # query positions: one ascending run, e.g. 30 .. 36
    n_prompt: int
    # Per layer: head_mean's weights [queries, rows, n_prompt] (rows: 1 or kv_heads); qk's q and k.
    kept: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    sparse: set[int] = field(default_factory=set)
    done: bool = False

    @classmethod
    def start(cls, spec: ProbeSpec, num_layers: int, n_prompt: int) -> "ProbeCapture":
        return cls(spec, spec.layer_indices(num_layers), spec.query_positions(n_prompt), n_prompt)

    def wants(self, start: int, length: int) -> bool:
        """Whether a row writing positions start .. start+length-1 holds anything to capture."""
        if self.done:
            return False
        if self.spec.kind == "qk":
            return start < self.n_prompt
        return start <= self.positions[-1] and self.positions[0] < start + length

    def take(self, layer: int, start: int, q: torch.Tensor, k: torch.Tensor, keys: torch.Tensor,
             selected: torch.Tensor | None) -> None:
        """One row of layer `layer`: q [T, heads, d] and k [T, kv_heads, d] post-RoPE at positions
        start .. start+T-1, keys [kv_heads, start+T, d] the slot's keys as attention reads them,
        selected [T, start+T] the keys a QSA layer's queries attended (None: all before them)."""
        first = self.positions[0]
        lo, hi = max(start, first), min(start + len(q), self.positions[-1] + 1)
        qs = q[lo - start:max(lo, hi) - start].float()  # the row's query positions lo .. hi-1
        rows = slice(lo - first, lo - first + len(qs))
        kept = self._kept(layer, q, k)
        if self.spec.kind == "qk":
            kept["q"][rows] = qs
            n = min(len(k), self.n_prompt - start)
            kept["k"][start:start + n] = k[:n].float()
            return
        positions = torch.arange(lo, hi, device=keys.device)  # a stage's device, as its keys
        allowed = torch.arange(keys.shape[1], device=keys.device) <= positions[:, None]
        if selected is not None:
            attended = selected[lo - start:lo - start + len(qs)]
            if bool((attended != allowed).any()):
                self.sparse.add(layer)
            allowed = attended
        kept["w"][rows, :, :keys.shape[1]] = self._weights(qs, keys.float(), allowed)

    def _weights(self, q: torch.Tensor, keys: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d)) over the allowed keys, averaged over each kv head's query heads
        (reduce "none") or over all heads: [T, rows, L]."""
        t, heads, d = q.shape
        kv_heads = keys.shape[0]
        qg = q.view(t, kv_heads, heads // kv_heads, d)
        scores = torch.einsum("tkgd,kld->tkgl", qg, keys) * d ** -0.5
        weights = scores.masked_fill(~allowed[:, None, None, :], -torch.inf).softmax(-1).mean(2)
        return weights.mean(1, keepdim=True) if self.spec.reduce == "mean" else weights

    def _kept(self, layer: int, q: torch.Tensor, k: torch.Tensor) -> dict[str, torch.Tensor]:
        if layer not in self.kept:
            nq, p = len(self.positions), self.n_prompt
            if self.spec.kind == "qk":
                self.kept[layer] = {"q": torch.zeros(nq, *q.shape[1:]), "k": torch.zeros(p, *k.shape[1:])}
            else:
                rows = 1 if self.spec.reduce == "mean" else k.shape[1]
                self.kept[layer] = {"w": torch.zeros(nq, rows, p)}
        return self.kept[layer]

    def result(self) -> list[LayerProbe]:
        """The layers' results once the prompt has run; the capture takes nothing more."""
        self.done = True
        out = []
        for layer in self.layers:
            kept = self.kept[layer]
            if self.spec.kind == "qk":
                out.append(LayerProbe(layer, dict(kept), self.positions, range(self.n_prompt), False))
                continue
            values, end = self._reduce(kept["w"])
            out.append(LayerProbe(layer, {"values": values}, self.positions, range(end), layer in self.sparse))
        self.kept.clear()
        return out

    def _reduce(self, w: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Weights [queries, rows, prompt] -> the result's values and how many key positions they
        cover. Each group's mean counts the positions its queries can see: "all" gives each query
        its own row; the other forms average their queries' weights over the keys up to the last
        of them (a window's earlier queries pay 0 to the keys after them)."""
        group, positions = self.spec.group, torch.tensor(self.positions)
        if self.spec.query == "all":
            values = group_means(w, (positions + 1)[:, None], group).transpose(0, 1)  # [rows, queries, groups]
            end = self.n_prompt
        else:
            end = self.positions[-1] + 1
            values = group_means(w[:, :, :end].mean(0), torch.tensor(end), group)  # [rows, groups]
        return (values[0] if self.spec.reduce == "mean" else values), end


def group_means(w: torch.Tensor, ends: torch.Tensor, group: int) -> torch.Tensor:
    """w [..., L] weights over key positions, zero past each row's end; ends (broadcast to w's
    leading axes) the key positions each row counts. -> [..., ceil(L/group)]: each group's mean over
    its counted positions, 0 for a group with none."""
    length = w.shape[-1]
    group = min(group, length)  # a group as long as the keys or longer holds them all
    n = -(-length // group)
    sums = F.pad(w, (0, n * group - length)).unflatten(-1, (n, group)).sum(-1)
    counts = (ends[..., None] - torch.arange(n) * group).clamp(0, group)
    return torch.where(counts > 0, sums / counts.clamp(min=1), 0.0)
