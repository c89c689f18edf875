"""The engine's settings, validated once when built: EngineConfig, SpecConfig, DraftLimits, and the
named choices they take (weight formats, KV cache types, drafters, compress ratio patterns).

A leaf: stdlib, engine.errors and engine.placement only, so the server's flag parser (and the proxy,
through it) can build and check a configuration without importing torch. The engine modules key
their torch types by these names."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from engine import cpu
from engine.errors import check_rules
from engine.placement import is_device_name

# Weight formats; "auto": each tensor as the file stores it (GGUF's q4_0, q4_1, q5_0, q8_0 blocks), the
# file's other block types in the nearest of those (engine/files/weights.py), else f32.
DTYPES = ("f32", "bf16", "int8", "q4_0", "q4_1", "q5_0", "q8_0", "auto")
# What block weights multiply: f32 activations, or activations quantized to 8 bits per block of 32
# (integer dot products, AVX-512 VNNI); auto: q8 where the CPU has it (docs/architecture.md, "Weight formats").
ACTIVATIONS = ("auto", "f32", "q8")
BLOCK_DTYPES = ("q4_0", "q4_1", "q5_0", "q8_0", "auto")  # those that keep a file's blocks (engine/ops/quant.py)
KV_CACHE_TYPES = ("f32", "f16", "bf16", "q8_0")
# Positions per page of a unified KV pool (--kv-unified).
PAGE_SIZE = 16
# The draft shipped with the engine package for the default model (`-md default`); how it was made:
# configs/drafts/smollm2-135m-mtp.md.
DEFAULT_DRAFT = Path(__file__).parent / "drafts" / "smollm2-135m-mtp.safetensors"
# Drafter names as llama-server spells them, and short aliases, each to its canonical name.
SPEC_TYPES = {"draft-mtp": "draft-mtp", "mtp": "draft-mtp", "ngram-simple": "ngram-simple",
              "ngram": "ngram-simple", "draft-simple": "draft-simple", "draft": "draft-simple",
              "draft-mtp-ngram": "draft-mtp-ngram", "mtp-ngram": "draft-mtp-ngram"}
# The --spec-type that turns speculation off, as llama-server spells it; not a drafter.
SPEC_NONE = "none"


@dataclass(frozen=True)
class CompressRatios:
    """`--compress-ratios` as given, checked for syntax only (the layer counts come from the model):
    a comma list of ratios (the trunk's layers, or the trunk's then the draft's), or a pattern over
    the trunk's layers: `everyN:R` (ratio R on layers N-1, 2N-1, ...: every Nth, counting from 1),
    `all:R`, or `none`. A ratio is 0 (dense) or >= 2 (QSA)."""
    values: tuple[int, ...] = ()  # the list form
    every: int = 0  # the pattern form: every Nth trunk layer (1: all of them) ...
    ratio: int = 0  # ... gets this ratio, the others 0

    @classmethod
    def parse(cls, text: str) -> "CompressRatios":
        """Raises ValueError with the rule a malformed value breaks."""
        rule = "must be a comma list of ratios (0 or >= 2), everyN:R, all:R or none"
        text = text.strip()
        if text == "none":
            return cls(every=1, ratio=0)
        name, colon, value = text.partition(":")
        if colon:
            every = 1 if name == "all" else int(name[5:]) if name.startswith("every") and name[5:].isdigit() else 0
            if every < 1 or not value.isdigit() or int(value) < 2:
                raise ValueError(rule)
            return cls(every=every, ratio=int(value))
        parts = text.split(",")
        if not all(p.strip().isdigit() for p in parts) or any(int(p) == 1 for p in parts):
            raise ValueError(rule)
        return cls(values=tuple(int(p) for p in parts))

    def expand(self, trunk: int) -> tuple[int, ...]:
        """The ratios for `trunk` layers, then any the list gives beyond them (the draft's)."""
        if self.values:
            return self.values
        return tuple(self.ratio if (i + 1) % self.every == 0 else 0 for i in range(trunk))


@dataclass(frozen=True)
class DraftLimits:
    """How much one request drafts per step, llama-server's names: the server's --spec-draft-*
    settings, or the request's own `speculative.n_max`, `n_min` and `p_min`
    (SpecConfig.request_limits checks them against the server's)."""
    n_max: int  # 0: no drafts for this request
    n_min: int
    p_min: float


@dataclass(frozen=True)
class SpecConfig:
    """Speculative decoding settings, llama-server's names. An MTP draft_model of "default" becomes
    the path of the draft the engine ships (DEFAULT_DRAFT), so everything downstream (its
    checks, /props, the footprint) sees the file."""
    type: str  # canonical: draft-mtp, draft-mtp-ngram, ngram-simple or draft-simple
    draft_model: str | None = None
    n_max: int = 3
    n_min: int = 0
    p_min: float = 0.5
    ngram_n: int = 3
    # Speculate only while at most this many requests decode (0: always). Each decoding request
    # adds 1 + n_max verify rows, and on a CPU a step of many rows is bound by arithmetic, not by
    # reading the weights: there a draft accepted 40% of the time costs more than it saves.
    max_batch: int = 0
    # Candidates per depth: the chain's token and up to width-1 siblings, the draft's next most
    # likely tokens with at least p_sibling probability each (engine.sched.request.Draft). 1: a chain.
    width: int = 1
    p_sibling: float = 0.1
    # Pause a request's drafting while its measured gain at its context is below 1
    # (engine.spec.pacing). Off: every step drafts, as tests of the verify paths need.
    pacing: bool = True

    def __post_init__(self) -> None:
        if self.runs_mtp and self.draft_model == "default":
            object.__setattr__(self, "draft_model", str(DEFAULT_DRAFT))
        check_rules([
            (self.type in SPEC_TYPES.values(), "spec_type", self.type, f"must be one of {', '.join(SPEC_TYPES)}"),
            (self.n_max >= 1, "spec_draft_n_max", self.n_max, "must be >= 1"),
            (0 <= self.n_min <= self.n_max, "spec_draft_n_min", self.n_min,
             f"must be in 0..spec_draft_n_max={self.n_max}"),
            (0 <= self.p_min <= 1 and not math.isnan(self.p_min), "spec_draft_p_min", self.p_min, "must be in [0, 1]"),
            (self.ngram_n >= 1, "spec_ngram_size_n", self.ngram_n, "must be >= 1"),
            (self.max_batch >= 0, "spec_max_batch", self.max_batch, "must be >= 0 (0: no limit)"),
            (1 <= self.width <= 8, "spec_draft_width", self.width, "must be in 1..8"),
            (self.width == 1 or self.type != "ngram-simple", "spec_draft_width", self.width,
             "must be 1 with spec_type=ngram-simple: siblings come from a draft model's distribution"),
            (0 <= self.p_sibling <= 1 and not math.isnan(self.p_sibling), "spec_draft_p_sibling", self.p_sibling,
             "must be in [0, 1]"),
            # An MTP draft may be the model's own MTP layers (engine/preflight.py checks it has them).
            (self.type == "ngram-simple" or self.runs_mtp or self.draft_model, "spec_draft_model", self.draft_model,
             f"is required with spec_type={self.type}"),
        ])

    @property
    def runs_mtp(self) -> bool:
        """Whether a detached MTP draft runs (alone, or with the n-gram lookup)."""
        return self.type in ("draft-mtp", "draft-mtp-ngram")

    @property
    def verify_rows(self) -> int:
        """The most tokens a decode row verifies after its last one: the chain and its siblings."""
        return self.n_max * self.width

    @property
    def limits(self) -> DraftLimits:
        """What a request that gives no limits of its own drafts under."""
        return DraftLimits(self.n_max, self.n_min, self.p_min)

    def request_limits(self, n_max: int | None = None, n_min: int | None = None,
                       p_min: float | None = None) -> DraftLimits:
        """A request's own limits (llama-server's `speculative.n_max`, `n_min`, `p_min`), the
        server's where it gives none. Their ranges are checked at the edge (server.protocol); here
        the rules that need the server's settings: n_max fits the verify rows, which are sized for
        spec_draft_n_max, and a given n_min is at most the request's n_max. The server's n_min
        shrinks to a smaller n_max, as llama-server clamps it."""
        n_max = self.n_max if n_max is None else n_max
        check_rules([
            (n_max <= self.n_max, "speculative.n_max", n_max,
             f"must be <= the server's --spec-draft-n-max={self.n_max} (its verify rows are sized for it)"),
            (n_min is None or n_min <= n_max, "speculative.n_min", n_min, f"must be in 0..speculative.n_max={n_max}"),
        ])
        return DraftLimits(n_max, min(self.n_min, n_max) if n_min is None else n_min,
                           self.p_min if p_min is None else p_min)


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # path, or None / "default" for the embedded SmolLM2
    dtype: str = "f32"
    activations: str = "auto"
    ctx_size: int = 4096  # total positions, split evenly across the slots (or shared: kv_unified)
    parallel: int = 1
    batch_size: int = 2048
    ubatch_size: int = 512
    cache_type: str | None = None  # K (and V unless cache_type_v says otherwise); None: the compute dtype
    cache_type_v: str | None = None
    kv_unified: bool = False
    threads: int | None = None
    chat_template: str | None = None
    spec: SpecConfig | None = None
    compress_ratios: CompressRatios | None = None  # overrides the model's (and the draft's, in list form)
    qsa_budget: int | None = None  # overrides the model's
    pipeline_parallel_size: int = 1  # processes the trunk's stages run in (engine/pipeline)
    pipeline_depth: int | None = None  # micro-batches a step splits into; None: one per stage
    pipeline_timeout: float = 8.0  # seconds the head waits for the stages' answer to one micro-batch
    # Where the trunk's layers and the draft run (engine/placement.py): one stage per device, the
    # layers split by count or in proportion (neither: as evenly as they go).
    devices: tuple[str, ...] = ("cpu",)
    layer_split: tuple[int, ...] | None = None
    tensor_split: tuple[float, ...] | None = None
    draft_device: str = "cpu"
    # The draft in a process of its own, the last rank of the group (engine/pipeline/draft_rank.py).
    draft_rank: bool = False
    # Whether `parallel` and `kv_unified` are the server's choice (neither -np nor --kv-unified
    # given): where a setting the user gave cannot take them, they yield (engine/preflight.py).
    auto_slots: bool = False
    # The defaults that yielded, and why, a line each: the load log and /props say them.
    adapted: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        kv_types = f"must be one of {', '.join(KV_CACHE_TYPES)}"
        check_rules([
            (self.dtype in DTYPES, "dtype", self.dtype, f"must be one of {', '.join(DTYPES)}"),
            (self.activations in ACTIVATIONS, "activations", self.activations, f"must be one of {', '.join(ACTIVATIONS)}"),
            (self.activations != "q8" or self.dtype in BLOCK_DTYPES, "activations", self.activations,
             f"8-bit activations multiply block weights: dtype must be one of {', '.join(BLOCK_DTYPES)}, got {self.dtype}"),
            (self.activations != "q8" or cpu.has_q8_activations(), "activations", self.activations,
             f"8-bit activations need a CPU with {', '.join(cpu.Q8_ACTIVATION_FLAGS)} or with "
             f"{', '.join(cpu.Q8_ACTIVATION_FLAGS_AVX2)}; this one lacks them "
             "(auto takes f32 here)"),
            (self.cache_type is None or self.cache_type in KV_CACHE_TYPES, "cache_type", self.cache_type, kv_types),
            (self.cache_type_v is None or self.cache_type_v in KV_CACHE_TYPES, "cache_type_v", self.cache_type_v,
             kv_types),
            (not self.kv_unified or self.ctx_size >= PAGE_SIZE, "ctx_size", self.ctx_size,
             f"must be at least {PAGE_SIZE} with kv_unified"),
            (self.parallel >= 1, "parallel", self.parallel, "must be >= 1"),
            (self.ctx_size >= self.parallel, "ctx_size", self.ctx_size, f"must be at least parallel={self.parallel}"),
            (self.ubatch_size >= 1, "ubatch_size", self.ubatch_size, "must be >= 1"),
            (self.batch_size >= self.parallel, "batch_size", self.batch_size,
             f"must be at least parallel={self.parallel}"),
            (self.threads is None or self.threads >= 1, "threads", self.threads, "must be >= 1"),
            (len(self.devices) >= 1 and all(map(is_device_name, self.devices)), "devices", self.devices,
             "must be one or more of cpu, cuda:N"),
            (is_device_name(self.draft_device), "draft_device", self.draft_device, "must be cpu or cuda:N"),
            (self.pipeline_parallel_size >= 1, "pipeline_parallel_size", self.pipeline_parallel_size, "must be >= 1"),
            (self.pipeline_depth is None or self.pipeline_depth >= 1, "pipeline_depth", self.pipeline_depth,
             "must be >= 1"),
            (self.pipeline_timeout > 0, "pipeline_timeout", self.pipeline_timeout, "must be > 0"),
            (not self.draft_rank or (self.spec is not None and self.spec.type != "ngram-simple"), "spec_draft_rank",
             self.draft_rank, f"needs a draft model to place (spec_type draft-mtp, draft-mtp-ngram or draft-simple), "
                              f"not spec_type={self.spec.type if self.spec else 'none'}"),
        ])

    @property
    def ctx_per_slot(self) -> int:
        """Positions one request may use: its share, or the whole pool when it is unified."""
        if self.kv_unified:
            return self.ctx_size // PAGE_SIZE * PAGE_SIZE
        return self.ctx_size // self.parallel

    @property
    def world(self) -> int:
        """Processes the engine runs in: one per pipeline stage, and the draft's own rank."""
        return self.pipeline_parallel_size + int(self.draft_rank)

    @property
    def depth(self) -> int:
        """Micro-batches of a step in flight at once: one in one process, whose stages share it."""
        return self.pipeline_depth or self.pipeline_parallel_size if self.pipeline_parallel_size > 1 else 1

    @property
    def state_steps(self) -> int:
        """Positions whose recurrent state a slot keeps (engine/model/recurrent_cache.py): the longest
        row a step writes token by token, a decode row with its drafts."""
        return 1 + (self.spec.verify_rows if self.spec is not None else 0)

    @property
    def kv_types(self) -> tuple[str, str]:
        """(K, V) cache types. By default the cache holds what attention computes in, so no step
        converts a slot's whole prefix: f32, or bf16 with bf16 weights."""
        k = self.cache_type or ("bf16" if self.dtype == "bf16" else "f32")
        return k, self.cache_type_v or k
