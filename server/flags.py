"""The server's command-line flags, named as llama-server's, parsed into ServerFlags: plain values,
each checked for its own syntax and range. Rules between flags (a context that fits the slots, a
draft model for a drafter that needs one) are the engine's, checked when server/cli.py builds its
config from these values.

Imports no torch and no engine model code: the proxy checks its profiles' args with it."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, fields
from typing import Callable, Sequence

from engine import CompressRatios
from engine.placement import parse_device, parse_devices, parse_layer_split, parse_proportions
from engine.settings import ACTIVATIONS, DTYPES, KV_CACHE_TYPES, SPEC_NONE, SPEC_TYPES
from engine.threads import parse_cpu_mask, parse_cpu_range
from server.logs import LOG_FORMATS, LOG_LEVELS

DEFAULT_BODY_LIMIT = 8 * 2**20
# Slots without -np, sharing one unified KV pool: llama-server's `-np auto`.
AUTO_PARALLEL = 4


class FlagError(ValueError):
    """A command line the server does not take, as one line naming the flag, the value and the rule."""


@dataclass(frozen=True)
class ServerFlags:
    model: str = "default"
    ctx_size: int = 4096
    parallel: int | None = None  # None: AUTO_PARALLEL slots with kv_unified
    batch_size: int = 2048
    ubatch_size: int = 512
    threads: int | None = None
    cpu_mask: frozenset[int] | None = None  # with cpu_range: the CPUs the process runs on (None: as started)
    cpu_range: frozenset[int] | None = None
    dtype: str = "auto"  # the file's own formats
    activations: str = "auto"  # 8-bit where the CPU has VNNI (engine.settings.ACTIVATIONS)
    kv_unified: bool = False
    cache_type_k: str | None = None
    cache_type_v: str | None = None
    chat_template: str | None = None
    host: str = "127.0.0.1"
    port: int = 8080
    alias: str | None = None
    api_key: str | None = None
    body_limit: int = DEFAULT_BODY_LIMIT
    drain_timeout: float = 60.0
    queue_limit: int | None = None  # None: unbounded
    timeout: float | None = None  # None: no time limit
    stream_interval_ms: float = 20.0
    log_level: str = "info"
    log_format: str = "text"
    spec_type: str | None = None  # as given: a name or an alias in engine.settings.SPEC_TYPES, or SPEC_NONE
    spec_draft_model: str | None = None
    spec_draft_n_min: int = 0
    spec_draft_n_max: int = 3
    spec_draft_p_min: float = 0.5
    spec_draft_width: int = 1
    spec_draft_p_sibling: float = 0.1
    spec_ngram_size_n: int = 3
    spec_max_batch: int = 1
    no_spec_pacing: bool = False
    spec_draft_device: str = "cpu"
    spec_draft_rank: bool = False
    devices: tuple[str, ...] = ("cpu",)
    layer_split: tuple[int, ...] | None = None  # None: by tensor_split, or as even as the layers go
    tensor_split: tuple[float, ...] | None = None
    compress_ratios: CompressRatios | None = None  # None: the model's own
    qsa_budget: int | None = None  # None: the model's own
    pipeline_parallel_size: int = 1
    pipeline_depth: int | None = None  # None: one micro-batch per stage
    pipeline_timeout: float = 8.0
    help: bool = False

    @property
    def cpus(self) -> frozenset[int] | None:
        """The CPUs -C and -Cr name together, or None when neither is given."""
        if self.cpu_mask is None and self.cpu_range is None:
            return None
        return (self.cpu_mask or frozenset()) | (self.cpu_range or frozenset())


class _Broken(Exception):
    """A value breaks its flag's rule (the message is the rule)."""


def _text(value: str) -> str:
    return value


def _ranged(kind: type[int] | type[float], low: float, high: float | None = None) -> Callable[[str], float]:
    """`kind` parses the text (int refuses "2.5"); the number must lie in [low, high]."""
    noun = "an integer" if kind is int else "a number"
    rule = f"must be {noun} >= {low:g}" if high is None else f"must be {noun} in [{low:g}, {high:g}]"

    def convert(value: str) -> float:
        try:
            x = kind(value)
        except ValueError:
            raise _Broken(rule) from None
        if not math.isfinite(x) or x < low or (high is not None and x > high):
            raise _Broken(rule)
        return x
    return convert


def _parsed(parse: Callable[[str], object]) -> Callable[[str], object]:
    """A parser that raises ValueError with the rule, as a flag's converter."""
    def convert(value: str) -> object:
        try:
            return parse(value)
        except ValueError as e:
            raise _Broken(str(e)) from None
    return convert


def _one_of(names) -> Callable[[str], str]:
    rule = f"must be one of {', '.join(names)}"

    def convert(value: str) -> str:
        if value not in names:
            raise _Broken(rule)
        return value
    return convert


@dataclass(frozen=True)
class _Flag:
    names: tuple[str, ...]
    help: str
    convert: Callable[[str], object] | None = _text  # None: a switch, true when given

    @property
    def dest(self) -> str:
        return self.names[-1].lstrip("-").replace("-", "_")


_FLAGS = (
    _Flag(("-m", "--model"), "HF directory, .gguf file, or 'default' (SmolLM2-135M)"),
    _Flag(("-c", "--ctx-size"), "total context, split across the slots", _ranged(int, 1)),
    _Flag(("-np", "--parallel"), "slots: requests generated at once (default: "
          f"{AUTO_PARALLEL} sharing one KV pool, as with --kv-unified; -np N splits the context N ways unless "
          "--kv-unified)", _ranged(int, 1)),
    _Flag(("-b", "--batch-size"), "most tokens one engine step takes", _ranged(int, 1)),
    _Flag(("-ub", "--ubatch-size"), "most prompt tokens one forward takes", _ranged(int, 1)),
    _Flag(("-t", "--threads"), "most torch threads (default: the cores; fewer while other processes keep them "
          "busy)", _ranged(int, 1)),
    _Flag(("-C", "--cpu-mask"), "CPUs to run on, a hexadecimal mask (0x3: CPUs 0 and 1); with --cpu-range, both's "
          "CPUs", _parsed(parse_cpu_mask)),
    _Flag(("-Cr", "--cpu-range"), "CPUs to run on, lo-hi", _parsed(parse_cpu_range)),
    _Flag(("--dtype",), "weight format (default: auto, each tensor as the file stores it, as llama-server serves "
          "it; f32 for a safetensors file)", _one_of(DTYPES)),
    _Flag(("--activations",), "what block weights multiply (default: auto, q8 where the CPU has AVX-512 VNNI, else "
          "f32): q8 quantizes activations per block of 32 to 8 bits for integer dot products, as llama.cpp "
          "does; f32 keeps them exact", _one_of(ACTIVATIONS)),
    _Flag(("--kv-unified",), "one KV pool shared by all slots", None),
    _Flag(("-ctk", "--cache-type-k"),
          "KV cache type for K (default: the compute type, f32 or bf16 with --dtype bf16)", _one_of(KV_CACHE_TYPES)),
    _Flag(("-ctv", "--cache-type-v"), "for V (default: as K)", _one_of(KV_CACHE_TYPES)),
    _Flag(("--chat-template",), "a Jinja chat template file replacing the model's"),
    _Flag(("--host",), "address to listen on"),
    _Flag(("--port",), "port to listen on", _ranged(int, 1, 65535)),
    _Flag(("--alias",), "the model name served (requests may also say 'default')"),
    _Flag(("--api-key",), "require 'Authorization: Bearer KEY' on every API call "
                            "(/health, /openapi.json and /docs stay open)"),
    _Flag(("--body-limit",), "largest request body, bytes", _ranged(int, 1)),
    _Flag(("--drain-timeout",), "seconds in-flight requests get to finish after SIGTERM", _ranged(float, 0)),
    _Flag(("--queue-limit",), "requests that may wait for a slot; one more gets 503 (default: unbounded)",
          _ranged(int, 0)),
    _Flag(("--timeout",), "seconds a request may take, waiting included; then it ends with finish_reason "
                          "'timeout' (default: no limit)", _ranged(float, 0)),
    _Flag(("--stream-interval-ms",), "a stream sends what was generated at most this often, after its first "
                                     "token (0: every step's tokens at once)", _ranged(float, 0)),
    _Flag(("--log-level",), "least severe log level written", _one_of(LOG_LEVELS)),
    _Flag(("--log-format",), "text, or json: one object per line", _one_of(LOG_FORMATS)),
    _Flag(("--spec-type",), f"drafter for speculative decoding, or {SPEC_NONE} (default: draft-mtp with the "
          "shipped draft for -m default, else none; draft-mtp-ngram: the n-gram lookup's continuation where the MTP "
          "draft agrees with it, else the MTP draft's)", _one_of(sorted([*SPEC_TYPES, SPEC_NONE]))),
    _Flag(("-md", "--spec-draft-model"), "the MTP draft file (draft-mtp, draft-mtp-ngram; 'default': the one shipped "
          "for the default model) or draft model (draft-simple)"),
    _Flag(("--spec-draft-n-min",), "draft fewer than this: decode normally", _ranged(int, 0)),
    _Flag(("--spec-draft-n-max",), "most tokens drafted per step", _ranged(int, 1)),
    _Flag(("--spec-draft-p-min",), "stop drafting when the draft's top-1 probability is below this",
          _ranged(float, 0, 1)),
    _Flag(("--spec-draft-width",), "candidates verified per draft depth: the chain's token and up to N-1 siblings, "
          "the draft's next most likely tokens, tried where it is rejected (default: 1, a chain)", _ranged(int, 1, 8)),
    _Flag(("--spec-draft-p-sibling",), "least draft probability a sibling needs", _ranged(float, 0, 1)),
    _Flag(("--spec-max-batch",), "speculate only while at most this many requests decode (0: always); on a CPU "
          "more verify rows cost more than the drafts save", _ranged(int, 0)),
    _Flag(("--no-spec-pacing",), "draft at every step; by default a request's drafting pauses while its measured "
          "gain at its context is below 1 (long contexts)", None),
    _Flag(("--spec-ngram-size-n",), "n-gram length ngram-simple and draft-mtp-ngram look up", _ranged(int, 1)),
    _Flag(("-devd", "--device-draft", "--spec-draft-device"),
          "device the whole draft runs on (its layers, head, cache): cpu, cuda or cuda:N", _parsed(parse_device)),
    _Flag(("--spec-draft-rank",), "run the draft in a process of its own, the last rank of the torch.distributed "
          "group (started here, or under torchrun one more process than -pp), on its --spec-draft-device; the head "
          "sends it each step's spans and hidden states and receives the drafts", None),
    _Flag(("-dev", "--device", "--devices"), "devices the trunk's layers run on, one stage each, in order: a comma "
          "list of cpu, cuda, cuda:N (the embedding sits on the first, the final norm and lm_head on the last)",
          _parsed(parse_devices)),
    _Flag(("--layer-split",), "trunk layers per device, a comma list summing to the model's layer count "
          "(default: as even as they go)", _parsed(parse_layer_split)),
    _Flag(("-ts", "--tensor-split"), "layers per device in proportion, e.g. 3,1: device i ends at the layer count "
          "times the proportions so far over their sum, rounded half up", _parsed(parse_proportions)),
    _Flag(("--compress-ratios",), "each layer's compress ratio, 0 dense or r >= 2 QSA: a comma list (trunk, then "
          "draft layers), everyN:R (every Nth trunk layer), all:R or none (default: the model's)",
          _parsed(CompressRatios.parse)),
    _Flag(("--qsa-budget",), "positions of pooled blocks a QSA query keeps, a multiple of the ratio "
          "(default: the model's)", _ranged(int, 1)),
    _Flag(("-pp", "--pipeline-parallel-size"), "processes the trunk's layers are split over, one stage each, "
          "connected by torch.distributed; run alone it starts its workers itself, under torchrun each rank "
          "takes its stage", _ranged(int, 1)),
    _Flag(("--pipeline-depth",), "micro-batches (slot groups) a step splits into, so that stages work at once "
          "(default: the stages)", _ranged(int, 1)),
    _Flag(("--pipeline-timeout",), "seconds the head waits for the stages' answer to one micro-batch before it "
          "declares a stage hung", _ranged(float, 0.1)),
    _Flag(("-h", "--help"), "show the flags and exit", None),
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        raise FlagError(message)  # the caller decides: the server exits 2, the proxy names the profile


def _parser() -> argparse.ArgumentParser:
    defaults = {f.name: f.default for f in fields(ServerFlags)}
    p = _Parser(prog="python -m server", add_help=False, argument_default=argparse.SUPPRESS,
                description="tandem: one model behind an OpenAI-style HTTP server (flags as llama-server's)")
    for flag in _FLAGS:
        default = defaults[flag.dest]
        if isinstance(default, tuple):
            default = ",".join(default)
        shown = "" if default is None or flag.convert is None else f" (default: {default})"
        if flag.convert is None:
            p.add_argument(*flag.names, dest=flag.dest, action="store_true", help=flag.help)
        else:
            p.add_argument(*flag.names, dest=flag.dest, metavar=flag.dest.upper(), help=flag.help + shown)
    return p


def help_text() -> str:
    return _parser().format_help()


def parse_flags(argv: Sequence[str] | None = None) -> ServerFlags:
    """Raises FlagError: `--dtype='nosuch': must be one of f32, bf16, int8, ...`."""
    given = vars(_parser().parse_args(argv))
    values = {}
    for flag in _FLAGS:
        if flag.dest not in given:
            continue
        value = given[flag.dest]
        if flag.convert is not None:
            try:
                value = flag.convert(value)
            except _Broken as e:
                raise FlagError(f"{flag.names[-1]}={value!r}: {e}") from None
        values[flag.dest] = value
    return ServerFlags(**values)
