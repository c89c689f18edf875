"""What a request may ask of a loaded engine, checked by the server before a slot is taken."""
from __future__ import annotations

from dataclasses import dataclass

from engine.errors import ConfigError, check_rules
from engine.model.probe import ProbeSpec


@dataclass(frozen=True)
class Admission:
    ctx_per_slot: int  # positions one request may use
    num_layers: int  # the trunk's
    head_layers: range | None  # under -pp, the layers the head runs itself (the only ones a probe sees)
    recurrent_layers: frozenset[int] = frozenset()  # linear-attention layers: no attention to probe

    def check_prompt(self, n_prompt: int, max_tokens: int | None) -> None:
        """Raise ConfigError unless a prompt of n_prompt tokens and max_tokens (None: as many as
        fit) fit one slot."""
        ctx = self.ctx_per_slot
        if n_prompt < 1:
            raise ConfigError("prompt: must contain at least one token")
        if n_prompt >= ctx:
            raise ConfigError(f"prompt has {n_prompt} tokens: the slot context is {ctx} (leave room to generate)")
        if max_tokens is not None and n_prompt + max_tokens > ctx:
            raise ConfigError(f"max_tokens={max_tokens}: the prompt's {n_prompt} tokens plus max_tokens exceed "
                              f"the slot context {ctx} (at most {ctx - n_prompt})")

    def check_probe(self, probe: ProbeSpec, n_prompt: int) -> None:
        """Raise ConfigError unless the probe fits this model and a prompt of n_prompt tokens. Under
        -pp only the head's own stage can be probed: its workers' layers send back hidden states only."""
        probe.check(self.num_layers, n_prompt)
        check_rules([(layer not in self.recurrent_layers, "attention_probe.layers", layer,
                      "is a linear_attention (recurrent) layer: it has no attention weights to probe")
                     for layer in probe.layer_indices(self.num_layers)])
        if self.head_layers is not None:
            own = self.head_layers
            rule = f"probes need a single process: under -pp only the head's layers {own.start}..{own.stop - 1} can be probed"
            check_rules([(layer in own, "attention_probe.layers", layer, rule)
                         for layer in probe.layer_indices(self.num_layers)])

    def room_after(self, n_prompt: int) -> int:
        """The most tokens a request with an n_prompt-token prompt can generate."""
        return self.ctx_per_slot - n_prompt
