"""Grammars: the tokens a request may produce next, from a JSON schema, a GBNF or Lark grammar or a
regex (docs/architecture.md, "Constrained decoding").

llguidance compiles a grammar against the model's vocabulary and a matcher per request follows the
committed tokens; it was chosen over xgrammar (`python -m bench.grammar_libs`): it needs no other
package (xgrammar brings triton, a gigabyte), compiles a schema 10x faster, and bounds a hostile
grammar by its own fuel limits, while its mask costs ~0.05 ms a row, under 1% of a decode step.

`Grammars` compiles, off the engine thread, and caches by source; `Constraint` is one request's
matcher, living with the request on the head: it masks each verify row for the row's own prefix,
cuts a draft at its first refused token, and advances on every committed token. A preempted
request keeps its tokens, so its matcher stays where it was.
"""
from __future__ import annotations

import json
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Literal

import torch

from engine.errors import ConfigError
from engine.sched.request import Draft

MAX_SOURCE = 256 * 1024  # characters of a schema or grammar: past this, refused before compiling
CACHED = 64  # compiled grammars kept, the most recently used
ROWS = 8  # verify rows a matcher's mask buffer holds before it grows
_SHIFTS = torch.arange(32, dtype=torch.int32)
# Whitespace between JSON tokens is bounded, as llama.cpp's schema grammars bound it: unbounded, a
# model that prefers a newline to the value can fill its whole answer with them. A schema's own
# "x-guidance" options come after these.
JSON_OPTIONS = {"whitespace_pattern": r"[ \t\n\r]{0,20}"}


class GrammarError(ConfigError):
    """A grammar that cannot be used: the message names the field and the problem."""


@dataclass(frozen=True)
class GrammarSpec:
    """What a request constrains its output to; `field` is the request field it came from, for errors."""
    kind: Literal["json_schema", "json_object", "gbnf", "lark", "regex"]
    source: str = ""  # the schema as JSON text, or the grammar's or regex's text
    field: str = "grammar"

    @classmethod
    def json_schema(cls, schema: dict | bool, field: str) -> "GrammarSpec":
        return cls("json_schema", json.dumps(schema), field)


def _limits():
    import llguidance
    # llguidance's defaults, made explicit: the fuel bounds a grammar's lexer and each step's work.
    return llguidance.LLParserLimits(initial_lexer_fuel=1_000_000, step_lexer_fuel=200_000,
                                     max_grammar_size=500_000, verbose_errors=True)


class Grammars:
    """Compiles grammars for one model's vocabulary. Thread-safe: the server compiles on worker
    threads while the engine thread runs the matchers."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: frozenset[int]):
        self._hf, self.vocab_size, self._eos = hf_tokenizer, vocab_size, sorted(eos_ids)
        self._tokenizer = None
        self._lock = threading.Lock()
        self._compiled: OrderedDict[tuple[str, str], str] = OrderedDict()

    def _llg_tokenizer(self):
        with self._lock:
            if self._tokenizer is None:  # ~0.3 s for a 49k vocabulary: made on the first grammar
                import llguidance.hf
                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size,
                                                               eos_token=self._eos)
            return self._tokenizer

    def compile(self, spec: GrammarSpec) -> str:
        """The spec as llguidance's grammar, checked against the vocabulary; raises GrammarError."""
        import llguidance
        if len(spec.source) > MAX_SOURCE:
            raise GrammarError(f"{spec.field}: {len(spec.source)} characters, more than the {MAX_SOURCE} allowed")
        key = (spec.kind, spec.source)
        with self._lock:
            if key in self._compiled:
                self._compiled.move_to_end(key)
                return self._compiled[key]
        tokenizer = self._llg_tokenizer()
        try:
            grammar = _to_llguidance(spec)
        except Exception as e:  # each converter raises its own kind, each naming the problem
            raise GrammarError(f"{spec.field}: {_first_line(e)}") from None
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer, limits=_limits())
        if failed:
            raise GrammarError(f"{spec.field}: {_first_line(messages[0])}")
        with self._lock:
            self._compiled[key] = grammar
            while len(self._compiled) > CACHED:
                self._compiled.popitem(last=False)
        return grammar

    def constraint(self, spec: GrammarSpec) -> "Constraint":
        """A fresh matcher for one request."""
        import llguidance
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), self.compile(spec), limits=_limits())
        if matcher.is_error():
            raise GrammarError(f"{spec.field}: {_first_line(matcher.get_error())}")
        return Constraint(matcher, self.vocab_size)


def _to_llguidance(spec: GrammarSpec) -> str:
    import llguidance
    from llguidance.gbnf_to_lark import gbnf_to_lark
    if spec.kind in ("json_object", "json_schema"):
        schema = {"type": "object"} if spec.kind == "json_object" else _closed(json.loads(spec.source))
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if spec.kind == "gbnf":
        return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(spec.source))
    if spec.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(spec.source)
    return llguidance.LLMatcher.grammar_from_regex(spec.source)


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_VALUES = ("const", "enum", "default", "examples")  # JSON values, whatever keys they hold


def embedded_schema(schema):
    """A JSON schema as a Lark grammar embeds it (`%json {...}`), read as a json_schema request is:
    objects closed, whitespace bounded (its own x-guidance options still win)."""
    schema = _closed(schema)
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": {**JSON_OPTIONS, **schema.get("x-guidance", {})}}
    return schema


def _closed(schema):
    """The schema with every object that lists its properties and says nothing of others closed to
    others (additionalProperties false), as llama.cpp's schema grammars read it and as OpenAI's
    strict mode requires: open, a small model fills an answer with made-up keys."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):  # names to schemas, not a schema
            out[key] = {name: _closed(sub) for name, sub in value.items()}
        else:
            out[key] = value if key in _VALUES else _closed(value)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


def _first_line(error) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


class Constraint:
    """One request's matcher. Used on the engine thread only."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        # Each row's allowed tokens, one bit each, as llguidance writes them: [rows, ceil(vocab/32)].
        # Written through its pointer: llguidance.torch would import torch.compile's machinery (2 s).
        self._bits = torch.empty((ROWS, (vocab_size + 31) // 32), dtype=torch.int32)

    @property
    def done(self) -> bool:
        """The grammar is complete: nothing but an end of text could follow."""
        return self.matcher.is_stopped()

    def advance(self, tokens: list[int]) -> None:
        """The request committed these tokens (each one the mask allowed)."""
        if tokens and not self.matcher.consume_tokens(tokens):
            raise GrammarError(f"grammar: a committed token was refused: {self.matcher.get_error()}")

    def allows(self, path: list[int], token: int) -> bool:
        """Whether `token` may follow `path` (tokens from the committed ones, each allowed): a
        walk of a few tokens, where a whole mask walks the vocabulary."""
        return self.matcher.validate_tokens([*path, token]) == len(path) + 1

    def best(self, logits: torch.Tensor, path: list[int]) -> int:
        """The likeliest token of one row of logits [vocab] that may follow `path`. The row's own
        argmax where the grammar allows it, as it mostly does (the mask then never needs making)."""
        token = int(logits.argmax())
        if self.allows(path, token):
            return token
        return int(logits.masked_fill(~self.masks([path])[0], -math.inf).argmax())

    def masks(self, paths: list[list[int]]) -> torch.Tensor:
        """[len(paths), vocab] bool: the tokens allowed after each path of tokens from the
        committed ones (a verify row's prefix; each path valid, as `cut` leaves drafts)."""
        if len(paths) > len(self._bits):
            self._bits = torch.empty((len(paths), self._bits.shape[1]), dtype=torch.int32)
        bits = self._bits[:len(paths)]
        for i, path in enumerate(paths):
            if path:
                self.matcher.consume_tokens(path)
            self.matcher.unsafe_compute_mask_ptr(bits[i].data_ptr(), bits.shape[1] * 4)
            if path:
                self.matcher.rollback(len(path))
        return ((bits.unsqueeze(-1) >> _SHIFTS) & 1).bool().view(len(paths), -1)[:, :self.vocab_size]

    def cut(self, draft: Draft) -> Draft:
        """The draft up to its first token the grammar refuses, with the siblings whose own path it
        allows. A refused chain token's distribution stays (`Draft.refused_q`): acceptance treats it
        as drafted and rejected, which keeps sampling exact (engine.spec.acceptance)."""
        n = self.matcher.validate_tokens(draft.tokens)
        siblings = [(d, t) for d, t in draft.siblings
                    if d <= n and self.matcher.validate_tokens(draft.tokens[:d] + [t]) == d + 1]
        if n == len(draft.tokens) and len(siblings) == len(draft.siblings):
            return draft
        q = draft.q
        cut = n < len(draft.tokens)
        return replace(draft, tokens=draft.tokens[:n], siblings=siblings, q=None if q is None else q[:n], cut=cut,
                       refused_q=q[n] if q is not None and cut else None)
