"""HTTP wire models shared by server, proxy and bench: request bodies, response shapes, errors.

Imports neither torch nor engine, so clients and the proxy can use it cheaply. Request bodies are
validated here for types and shapes (and text that is valid Unicode); the sampling parameters'
ranges are engine.sched.sampling.SamplingParams' own, and what needs the model (token counts, the
template) is checked by the server too, all before a slot is taken.
"""
from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from web import STATIC_PREFIX

MAX_STOP_STRINGS = 4
# The validators below word their own refusals; these tell /openapi.json's readers (clients,
# fuzzers) the same rules.
_NON_EMPTY = {"minItems": 1}
# What both HTTP apps answer without the API key: the health probe, the API's description (the
# /docs page loads its script and style from a CDN; /docs/oauth2-redirect serves OAuth flows only),
# and the browser pages with their files (package web), which hold no data: their API calls send the key.
OPEN_PATHS = ("/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/", "/ui")
ROLES = ("system", "user", "assistant", "tool", "developer")
# The endpoints that generate: each takes a slot, counts against the wait queue's limit, and is
# routed by the proxy to the server of the model its body names.
COMPLETION_PATHS = ("/v1/chat/completions", "/v1/completions", "/completion", "/v1/responses", "/v1/messages")


class APIError(Exception):
    """An error answered in the OpenAI shape; `message` names the field and the problem."""

    def __init__(self, status: int, message: str, type_: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        self.type = type_ or error_type(status)
        self.headers = headers

    def body(self) -> dict:
        return error_body(self.status, self.message, self.type)


def is_open(path: str) -> bool:
    # ".." is refused so that no path that could resolve outside the static files passes unchecked.
    return path in OPEN_PATHS or (path.startswith(STATIC_PREFIX) and ".." not in path)


def error_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error", 422: "invalid_request_error", 503: "unavailable_error"}.get(
        status, "server_error")


def error_body(status: int, message: str, type_: str | None = None) -> dict:
    return {"error": {"code": status, "message": message, "type": type_ or error_type(status)}}


class ErrorDetail(BaseModel):
    code: int
    message: str
    type: str


class ErrorResponse(BaseModel):
    """Every error either HTTP app answers, as OpenAI's API does."""
    error: ErrorDetail


# The OpenAPI schema's error answers, for every endpoint of both apps. "default" covers the rest
# (405, 413, 500) and keeps FastAPI from documenting a 422 that neither app sends.
ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": ErrorResponse, "description": description} for status, description in (
        (400, "Invalid request: the message names the field, the value and the rule"),
        (401, "Missing or wrong API key (with --api-key)"),
        (404, "No such endpoint, or a model this server does not serve"),
        (503, "Model loading, server draining, or the wait queue full (with Retry-After)"),
        ("default", "Any other error, in the same shape"))}


MAX_JSON_DEPTH = 128  # levels of [ and { a body may nest: deeper is refused before it is parsed
_JSON_STRING = re.compile(rb'"(?:[^"\\]++|\\.)*+"')
_JSON_NESTING = re.compile(rb"[\[\]{}]")


def body_problem(body: bytes) -> str | None:
    """What makes a request body unreadable as JSON text before it is parsed, named; None if nothing.
    Both HTTP apps ask before they parse: a parser would answer only that it failed, and a deep
    enough nesting exhausts its recursion."""
    try:
        body.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"body is not valid UTF-8 at byte {e.start}"
    depth = 0
    for bracket in _JSON_NESTING.findall(_JSON_STRING.sub(b'""', body)):
        depth += 1 if bracket in b"[{" else -1
        if depth > MAX_JSON_DEPTH:
            return f"JSON nested deeper than {MAX_JSON_DEPTH} levels of [ and {{"
    return None


def validation_problems(errors) -> list[str]:
    """pydantic's errors (`ValidationError.errors()`), one line each naming the field and the rule:
    `temperature: must be >= 0`. Both HTTP apps and the proxy's config reader word them this way."""
    out = []
    for err in errors:
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "json_invalid":
            where = f" at byte {loc}" if loc else ""
            out.append(f"malformed JSON{where}: {err.get('ctx', {}).get('error', msg)}")
            continue
        msg = {"missing": "field required", "extra_forbidden": "unknown key"}.get(err["type"], msg)
        out.append(f"{loc}: {msg}" if loc else msg)
    return out


class Body(BaseModel):
    # Inside a request (messages, tools, formats) a field tandem does not read is let through,
    # as the SDKs' own objects carry many; a request's top level is RequestBody's.
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _unicode(cls, data):
        """JSON may escape a lone surrogate ("\\ud800"), which no text encoding can carry: refused
        here, naming where, rather than failing in the tokenizer."""
        where = _lone_surrogate(data)
        if where is not None:
            path, i = where
            raise ValueError(f"{'.'.join(map(str, path)) or 'body'}: not valid Unicode text "
                             f"(a lone surrogate at character {i})")
        return data


# What a request's top level may carry that tandem ignores on purpose: OpenAI's bookkeeping, and
# llama-server's switches that tandem lacks, accepted only with the value that switches them off
# (the llama.cpp web UI sends them so). Any other field tandem does not read is refused, naming
# it; /props lists both.
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier",
                  "timings_per_token")
NEUTRAL_FIELDS = {"typical_p": 1.0, "mirostat": 0, "tfs_z": 1.0, "dynatemp_range": 0.0, "xtc_probability": 0.0,
                  "dry_multiplier": 0.0, "repeat_last_n": 64, "n_keep": 0, "min_keep": 0}


@functools.cache
def _read_fields(model: type[BaseModel]) -> frozenset[str]:
    """The top-level names a request model reads (a field's alias where it has one), once per class."""
    return frozenset(f.alias or name for name, f in model.model_fields.items())


class RequestBody(Body):
    """A request's whole body: every field is read, ignored on purpose (IGNORED_FIELDS), or refused."""
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _ignored(cls, data):
        if not isinstance(data, dict):
            return data
        ours = _read_fields(cls)
        switched_on = [f"{k}={data[k]!r}: not supported by this server (only {v!r}, which switches it off)"
                       for k, v in NEUTRAL_FIELDS.items() if k in data and k not in ours and data[k] != v]
        if switched_on:
            raise ValueError("; ".join(switched_on))
        return {k: v for k, v in data.items() if k in ours or (k not in IGNORED_FIELDS and k not in NEUTRAL_FIELDS)}


def _lone_surrogate(value, path: tuple = ()) -> tuple[tuple, int] | None:
    """(path, character index) of the first lone surrogate in a parsed JSON value, or None."""
    if isinstance(value, str):
        if value.isascii():
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return path, e.start
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            found = _lone_surrogate(k, path) or _lone_surrogate(v, (*path, k))
            if found:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _lone_surrogate(v, (*path, i))
            if found:
                return found
    return None


class StreamOptions(Body):
    include_usage: bool = False


PROBE_QUERY_RULE = 'must be "last", "all", a prompt index or {"last": w} with w >= 1'


class AttentionProbe(BaseModel):
    """The request's `attention_probe` (docs/architecture.md, "Attention probes"): types and shapes
    here; the limits and what needs the model or the prompt are engine.probe.ProbeSpec's rules."""
    model_config = ConfigDict(extra="forbid")
    layers: list[int] = Field(json_schema_extra=_NON_EMPTY)
    kind: Literal["head_mean", "qk"] = "head_mean"
    query: str | int | dict[str, int] = Field(default="last", json_schema_extra={"anyOf": [
        {"type": "string", "enum": ["last", "all"]}, {"type": "integer"},
        {"type": "object", "properties": {"last": {"type": "integer", "minimum": 1}}, "required": ["last"],
         "additionalProperties": False}]})
    group: int | None = Field(default=None, ge=1)
    reduce: Literal["mean", "none"] | None = None

    @field_validator("query", mode="before")
    @classmethod
    def _query(cls, v):
        """One rule for every wrong form, rather than one complaint per member of the union."""
        window = isinstance(v, dict) and list(v) == ["last"] and type(v["last"]) is int and v["last"] >= 1
        if v in ("last", "all") or type(v) is int or window:
            return v
        raise ValueError(PROBE_QUERY_RULE)


class JsonSchemaFormat(Body):
    """OpenAI's response_format.json_schema. `strict` is accepted and always holds: the answer is
    constrained to the schema token by token."""
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default=True, alias="schema")
    strict: bool | None = None


class ResponseFormat(Body):
    """OpenAI's response_format; llama-server's `{"type": "json_object", "schema": {...}}` too."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")

    @model_validator(mode="after")
    def _schema_given(self):
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object ({\"name\", \"schema\"})")
        return self


@dataclass(frozen=True)
class GrammarSource:
    """What a request constrains its answer to (engine.sched.grammar.GrammarSpec's fields, as the
    request gave them; this module imports no engine code)."""
    kind: Literal["json_schema", "json_object", "gbnf", "lark", "regex"]
    source: str
    field: str


class SamplingFields(RequestBody):
    """Generation parameters common to chat and text completions (OpenAI names plus llama-server's)."""
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = Field(default=None, ge=-2**63, lt=2**64)  # what a generator's seed can hold
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    logit_bias: dict[str, float] | list[list[float]] | None = Field(default=None, json_schema_extra={"anyOf": [
        {"type": "object", "additionalProperties": {"type": "number"}},
        {"type": "array", "items": {"type": "array", "items": {"type": "number"}, "minItems": 2, "maxItems": 2}},
        {"type": "null"}]})
    n: int = Field(default=1, json_schema_extra={"enum": [1]})
    # At most one of these constrains the answer: OpenAI's response_format, llama-server's
    # json_schema (a schema) or grammar (GBNF; "" is none, as llama-server reads it).
    response_format: ResponseFormat | None = None
    json_schema: dict[str, Any] | bool | None = None
    grammar: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    cache_prompt: bool = True
    id_slot: int | None = None
    attention_probe: AttentionProbe | None = None
    # llama-server's per-request speculation limits, flat keys with a dot as it reads them; absent:
    # the server's --spec-draft-n-max, -n-min, -p-min. The server checks them against its own
    # (SpecConfig.request_limits); a server that does not speculate ignores them, as llama-server does.
    spec_n_max: int | None = Field(default=None, alias="speculative.n_max", json_schema_extra={"minimum": 0})
    spec_n_min: int | None = Field(default=None, alias="speculative.n_min", json_schema_extra={"minimum": 0})
    spec_p_min: float | None = Field(default=None, alias="speculative.p_min",
                                     json_schema_extra={"minimum": 0, "maximum": 1})

    @model_validator(mode="before")
    @classmethod
    def _speculative_object(cls, data):
        """llama-server's flat keys may come as one object too, `"speculative": {"n_max": 2}`,
        checked as they are."""
        if not isinstance(data, dict) or "speculative" not in data:
            return data
        nested = data["speculative"]
        if not isinstance(nested, dict):
            raise ValueError(f"speculative: must be an object with n_max, n_min or p_min, got {nested!r}")
        unknown = sorted(set(nested) - {"n_max", "n_min", "p_min"})
        if unknown:
            raise ValueError(f"speculative: unknown key(s) {', '.join(unknown)} (it holds n_max, n_min, p_min)")
        flat = {f"speculative.{k}": v for k, v in nested.items()}
        twice = [k for k in flat if k in data]
        if twice:
            raise ValueError(f"{twice[0]}: given both flat and inside the speculative object; give one")
        return {**{k: v for k, v in data.items() if k != "speculative"}, **flat}

    @field_validator("spec_n_max", "spec_n_min")
    @classmethod
    def _draft_count(cls, v: int | None) -> int | None:
        if v is not None and v < 0:
            raise ValueError(f"must be >= 0 (0 drafts nothing), got {v}")
        return v

    @field_validator("spec_p_min")
    @classmethod
    def _draft_p_min(cls, v: float | None) -> float | None:
        if v is not None and not 0 <= v <= 1:
            raise ValueError(f"must be in [0, 1], got {v}")
        return v

    @model_validator(mode="after")
    def _draft_n_min(self):
        if None not in (self.spec_n_min, self.spec_n_max) and self.spec_n_min > self.spec_n_max:
            raise ValueError(f"speculative.n_min: must be in 0..speculative.n_max={self.spec_n_max}, "
                             f"got {self.spec_n_min}")
        return self

    @model_validator(mode="after")
    def _one_grammar(self):
        given = [name for name, v in (("response_format", self._format_grammar()), ("json_schema", self.json_schema),
                                      ("grammar", self.grammar)) if v not in (None, "")]
        if len(given) > 1:
            raise ValueError(f"{given[0]} and {given[1]}: give at most one, each constrains the whole answer")
        return self

    def _format_grammar(self) -> GrammarSource | None:
        rf = self.response_format
        if rf is None or rf.type == "text":
            return None
        if rf.type == "json_schema":
            return GrammarSource("json_schema", json.dumps(rf.json_schema.schema_),
                                 "response_format.json_schema.schema")
        if rf.schema_ is not None:
            return GrammarSource("json_schema", json.dumps(rf.schema_), "response_format.schema")
        return GrammarSource("json_object", "", "response_format")

    @property
    def grammar_source(self) -> GrammarSource | None:
        """The grammar the request's answer follows, or None."""
        if self.json_schema is not None:
            return GrammarSource("json_schema", json.dumps(self.json_schema), "json_schema")
        if self.grammar:
            return GrammarSource("gbnf", self.grammar, "grammar")
        return self._format_grammar()

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        """OpenAI's {"id": bias} or llama-server's [[id, bias], ...], kept as [[id, bias], ...] with
        integer ids: a list's 1.7 is refused, not read as token 1."""
        if v is None:
            return v
        if isinstance(v, dict):
            pairs = []
            for key, bias in v.items():
                try:
                    pairs.append([int(key), bias])
                except ValueError:
                    raise ValueError(f"key {key!r} is not a token id") from None
        else:
            if any(len(p) != 2 for p in v):
                raise ValueError("each entry must be a [token id, bias] pair")
            bad = [t for t, _ in v if not (math.isfinite(t) and float(t).is_integer())]
            if bad:
                raise ValueError(f"token id {bad[0]!r} is not an integer")
            pairs = [[int(t), b] for t, b in v]
        bad = [b for _, b in pairs if not math.isfinite(b) and b != -math.inf]
        if bad:
            raise ValueError(f"bias {bad[0]!r} must be a finite number (or -Infinity, a ban)")
        return pairs

    def bias_pairs(self) -> list[tuple[int, float]]:
        """logit_bias as (token id, bias)."""
        return [(t, b) for t, b in self.logit_bias or []]


TOOL_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class FunctionCall(Body):
    name: str
    arguments: str | dict[str, Any] = "{}"  # OpenAI sends JSON text; some clients an object

    @property
    def arguments_object(self) -> Any:
        """The arguments as a value (templates render them as JSON themselves)."""
        if isinstance(self.arguments, dict):
            return self.arguments
        try:
            return json.loads(self.arguments or "{}")
        except ValueError:
            raise APIError(400, f"messages: tool call {self.name!r}: arguments are not valid JSON: "
                                f"{self.arguments[:80]!r}") from None


class ToolCall(Body):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(Body):
    role: str = Field(json_schema_extra={"enum": list(ROLES)})
    content: str | list[dict[str, Any]] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, in the history
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    @field_validator("role")
    @classmethod
    def _role(cls, v: str) -> str:
        if v not in ROLES:
            raise ValueError(f"unknown role {v!r}: must be one of {', '.join(ROLES)}")
        return v

    def text(self) -> str:
        """Content as plain text; parts other than text are refused."""
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        pieces = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise APIError(400, f"messages: content part of type {part.get('type')!r} is not supported "
                                    "(only text)")
            pieces.append(part["text"])
        return "".join(pieces)


def _non_empty(v: list) -> list:
    if not v:
        raise ValueError("must not be empty")
    return v


Messages = Annotated[list[ChatMessage], AfterValidator(_non_empty), Field(json_schema_extra=_NON_EMPTY)]


class FunctionDef(Body):
    name: str = Field(pattern=TOOL_NAME)
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None


class Tool(Body):
    type: Literal["function"]
    function: FunctionDef


TOOL_CHOICE_RULE = 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}'


class ChatCompletionRequest(SamplingFields):
    messages: Messages
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Tool] | None = None
    # "auto" where tools are given, as OpenAI's; a function's name (from {"type": "function", ...})
    # calls that function.
    tool_choice: str | dict[str, Any] | None = Field(default=None, json_schema_extra={"anyOf": [
        {"type": "string", "enum": ["none", "auto", "required"]},
        {"type": "object", "properties": {"type": {"enum": ["function"]}, "function": {
            "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}}}]})
    parallel_tool_calls: bool = True

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, v):
        if v is None or v in ("none", "auto", "required"):
            return v
        named = isinstance(v, dict) and v.get("type") == "function" and isinstance(v.get("function"), dict) \
            and isinstance(v["function"].get("name"), str)
        if not named:
            raise ValueError(TOOL_CHOICE_RULE)
        return v

    @model_validator(mode="after")
    def _tools_agree(self) -> "ChatCompletionRequest":
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) < len(names):
            raise ValueError(f"tools: function names must differ, {names!r}")
        if isinstance(self.tool_choice, dict) and self.tool_choice["function"]["name"] not in names:
            raise ValueError(f"tool_choice: function {self.tool_choice['function']['name']!r} is not among "
                             f"the tools ({', '.join(names) or 'none given'})")
        if self.tool_choice not in (None, "none", "auto") and not names:
            raise ValueError("tool_choice: calls a tool but no tools are given")
        if self.tool_mode == "auto" and self.grammar is not None and self.grammar:
            raise ValueError("grammar and tools: a GBNF answer cannot stand beside tool calls; give one "
                             "(a response_format or json_schema can)")
        if self.tool_mode in ("required", "named") and self.grammar_source is not None:
            raise ValueError("tool_choice and a response format: a required call's arguments already follow "
                             "its function's parameters; give one")
        return self

    @property
    def tool_mode(self) -> Literal["none", "auto", "required", "named"]:
        """How the answer may call tools: not at all, as the model chooses, at least once, or one function."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, dict):
            return "named"
        return self.tool_choice or "auto"

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def n_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def translated_chat(data: dict) -> ChatCompletionRequest:
    """A chat made from another API's request (Responses, Messages): what it gets wrong is a 400
    in the chat's own field names."""
    try:
        return ChatCompletionRequest.model_validate(data)
    except ValidationError as e:
        raise APIError(400, "; ".join(validation_problems(e.errors()))) from None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str] = Field(json_schema_extra={"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "minItems": 1, "maxItems": 1}]})
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = Field(default=False, json_schema_extra={"enum": [False]})

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], str):
            if len(v) != 1:
                raise ValueError("only one prompt per request is supported")
            v = v[0]
        if isinstance(v, list) and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        if not v:
            raise ValueError("must not be empty")
        return v

    @field_validator("echo")
    @classmethod
    def _echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported")
        return v

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def n_logprobs(self) -> int | None:
        return self.logprobs


class LlamaCompletionRequest(SamplingFields):
    """llama-server's native POST /completion: its names (n_predict, n_probs) beside the common ones."""
    prompt: str | list[int] = Field(json_schema_extra={"anyOf": [
        {"type": "string", "minLength": 1}, {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}]})
    n_predict: int = -1  # -1: until a stop or the slot's end
    n_probs: int = Field(default=0, ge=0, le=20)

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if not v:
            raise ValueError("must not be empty")
        if isinstance(v, list) and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    @field_validator("n_predict")
    @classmethod
    def _n_predict(cls, v: int) -> int:
        if v == 0 or v < -1:
            raise ValueError(f"must be -1 (until a stop) or >= 1, got {v}")
        return v

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else None if self.n_predict < 0 else self.n_predict

    @property
    def n_logprobs(self) -> int | None:
        return self.n_probs or None


class ModelRequest(RequestBody):
    """A request that names its model, as the proxy routes it; the server checks it is its own."""
    model: str | None = None


class TokenizeRequest(ModelRequest):
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(ModelRequest):
    tokens: list[int]


class ApplyTemplateRequest(ModelRequest):
    messages: Messages


# -- responses ---------------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Timings(BaseModel):
    """llama-server's `timings`; draft_n and draft_n_accepted only when drafting ran, recomputed_n
    (positions computed again after the request was preempted and resumed) only when it was,
    probe_recomputed only when an attention probe ran the prompt whole (its cached prefix unused)."""
    model_config = ConfigDict(extra="allow")
    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float
    draft_n: int | None = None
    draft_n_accepted: int | None = None
    recomputed_n: int | None = None
    probe_recomputed: bool | None = None

    @classmethod
    def of(cls, t) -> "Timings":
        """From an engine.sched.request.RequestTimes (duck-typed: this module imports no engine code)."""
        def per_token(ms: float, n: int) -> float:
            return ms / n if n else 0.0

        def per_second(ms: float, n: int) -> float:
            return 1000.0 * n / ms if ms > 0 else 0.0

        drafted = t.draft_n > 0
        return cls(cache_n=t.cache_n, prompt_n=t.prompt_n, prompt_ms=t.prompt_ms,
                   prompt_per_token_ms=per_token(t.prompt_ms, t.prompt_n),
                   prompt_per_second=per_second(t.prompt_ms, t.prompt_n),
                   predicted_n=t.predicted_n, predicted_ms=t.predicted_ms,
                   predicted_per_token_ms=per_token(t.predicted_ms, t.predicted_n),
                   predicted_per_second=per_second(t.predicted_ms, t.predicted_n),
                   draft_n=t.draft_n if drafted else None, draft_n_accepted=t.draft_n_accepted if drafted else None,
                   recomputed_n=t.recomputed_n or None, probe_recomputed=t.probe_recomputed or None)


@dataclass
class TimingTotals:
    """Sums of `timings` objects as both /metrics pages count them (the server its own requests',
    the proxy each model's as they pass through)."""
    prompt_tokens: int = 0
    prompt_seconds: float = 0.0
    predicted_tokens: int = 0
    predicted_seconds: float = 0.0
    cached_tokens: int = 0
    draft_tokens: int = 0
    draft_accepted: int = 0

    def add(self, t: dict) -> None:
        """Raises TypeError or ValueError where a field is not a number; a field left out counts 0."""
        self.prompt_tokens += int(t.get("prompt_n") or 0)
        self.prompt_seconds += float(t.get("prompt_ms") or 0) / 1000
        self.predicted_tokens += int(t.get("predicted_n") or 0)
        self.predicted_seconds += float(t.get("predicted_ms") or 0) / 1000
        self.cached_tokens += int(t.get("cache_n") or 0)
        self.draft_tokens += int(t.get("draft_n") or 0)
        self.draft_accepted += int(t.get("draft_n_accepted") or 0)


# Why a response ended. "stop": end of text or a stop string or token; "length": max_tokens or the
# slot's context; "cancelled": the client left; "error": the request failed (alone: others go on);
# "timeout": the request ran past the server's --timeout and was ended there. A request preempted
# for want of KV room is resumed, never ended early.
FinishReason = Literal["stop", "length", "cancelled", "error", "timeout"]
