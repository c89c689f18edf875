"""LayerSpec: how one layer mixes tokens, given to each layer when it is built (docs/architecture.md,
"The hybrid cache and QSA"): dense attention, QSA (sparse attention over pooled key blocks,
engine/model/qsa.py) or a recurrent linear-attention layer (engine/model/gated_delta.py). The cache
gives each layer storage by its spec. Nothing looks a layer's kind up by index in a model-wide list."""
from __future__ import annotations

from dataclasses import dataclass

from engine.files.model_config import ModelConfig


@dataclass(frozen=True)
class LayerSpec:
    kind: str  # "dense", "qsa" or "recurrent"
    ratio: int = 0  # positions per pooled block (QSA)
    budget: int = 0  # positions of complete blocks a query may keep (QSA), a multiple of ratio
    # QSA layers of a model with its own indexer (Qwen4-Exp, engine/model/indexer.py): the indexer's
    # key width; 0 for tandem's pooled attention keys (engine/model/qsa.py).
    index_dim: int = 0

    @classmethod
    def of(cls, ratio: int, budget: int, index_dim: int = 0) -> "LayerSpec":
        """The spec of an attention layer with compress ratio `ratio` (0: dense) under the model's budget."""
        return cls("qsa", ratio, budget, index_dim) if ratio else DENSE

    @property
    def is_qsa(self) -> bool:
        return self.kind == "qsa"

    @property
    def is_recurrent(self) -> bool:
        return self.kind == "recurrent"

    @property
    def keep(self) -> int:
        """Complete blocks a query keeps past the budget, beside its tail."""
        return self.budget // self.ratio

    def describe(self) -> str:
        return f"qsa r={self.ratio}" if self.is_qsa else self.kind


DENSE = LayerSpec("dense")
RECURRENT = LayerSpec("recurrent")


def trunk_specs(config: ModelConfig, layers=None) -> list[LayerSpec]:
    """The specs of the trunk's layers (all, or those of `layers`): recurrent where the model has a
    linear-attention layer, else dense or QSA by its compress ratio."""
    indices = range(config.num_layers) if layers is None else layers
    index_dim = config.indexer.head_dim if config.indexer is not None else 0
    return [RECURRENT if config.is_recurrent(i) else LayerSpec.of(config.layer_ratios[i], config.qsa_budget, index_dim)
            for i in indices]
