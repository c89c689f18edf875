"""HTTP wire models shared by server, proxy and bench: request bodies, response shapes, errors.

Imports neither torch nor engine, so clients and the proxy can use it cheaply. Request bodies are
validated here for types and ranges; what needs the model (token counts, the template) is checked
by the server before a slot is taken.
"""
from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_STOP_STRINGS = 4
ROLES = ("system", "user", "assistant", "tool", "developer")


class APIError(Exception):
    """An error answered in the OpenAI shape; `message` names the field and the problem."""

    def __init__(self, status: int, message: str, type_: str | None = None):
        super().__init__(message)
        self.status, self.message = status, message
        self.type = type_ or error_type(status)

    def body(self) -> dict:
        return error_body(self.status, self.message, self.type)


def error_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
            413: "invalid_request_error", 422: "invalid_request_error", 503: "unavailable_error"}.get(
        status, "server_error")


def error_body(status: int, message: str, type_: str | None = None) -> dict:
    return {"error": {"code": status, "message": message, "type": type_ or error_type(status)}}


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


class _Body(BaseModel):
    # Unknown fields are accepted (clients send many) but never change behaviour.
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False


class SamplingFields(_Body):
    """Generation parameters common to chat and text completions (OpenAI names plus llama-server's)."""
    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repeat_penalty: float = 1.0
    logit_bias: dict[str, float] | list[list[float]] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    cache_prompt: bool = True
    id_slot: int | None = None

    @field_validator("temperature", "top_p", "presence_penalty", "frequency_penalty", "repeat_penalty")
    @classmethod
    def _finite(cls, v: float, info) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, v: float) -> float:
        if v < 0:
            raise ValueError("must be >= 0")
        return v

    @field_validator("top_p")
    @classmethod
    def _top_p(cls, v: float) -> float:
        if not 0 < v <= 1:
            raise ValueError("must be in (0, 1]")
        return v

    @field_validator("repeat_penalty")
    @classmethod
    def _repeat_penalty(cls, v: float) -> float:
        if v <= 0:
            raise ValueError("must be > 0")
        return v

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

    def bias_pairs(self) -> list[tuple[int, float]]:
        """logit_bias as (token id, bias): OpenAI's {"id": bias} or llama-server's [[id, bias], ...]."""
        if not self.logit_bias:
            return []
        try:
            if isinstance(self.logit_bias, dict):
                pairs = [(int(k), float(b)) for k, b in self.logit_bias.items()]
            else:
                pairs = [(int(p[0]), float(p[1])) for p in self.logit_bias]
        except (ValueError, IndexError) as e:
            raise APIError(400, f"logit_bias: keys must be token ids ({e})") from e
        if any(not math.isfinite(b) and b != -math.inf for _, b in pairs):
            raise APIError(400, "logit_bias: biases must be finite numbers")
        return pairs


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None

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


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("must not be empty")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> "ChatCompletionRequest":
        if self.tools:
            raise ValueError("tools are not supported by this server")
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise ValueError(f"response_format type {kind!r} is not supported (only 'text')")
        return self

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def n_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[int] | list[str]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False

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


class TokenizeRequest(_Body):
    content: str
    add_special: bool = False
    with_pieces: bool = False


class DetokenizeRequest(_Body):
    tokens: list[int]


class ApplyTemplateRequest(_Body):
    messages: list[ChatMessage]

    @field_validator("messages")
    @classmethod
    def _messages(cls, v: list[ChatMessage]) -> list[ChatMessage]:
        if not v:
            raise ValueError("must not be empty")
        return v


# -- responses ---------------------------------------------------------------------------------

class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class Timings(BaseModel):
    """llama-server's `timings`; draft_n and draft_n_accepted only when drafting ran, recomputed_n
    (positions computed again after the request was preempted and resumed) only when it was."""
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

    @classmethod
    def of(cls, t) -> "Timings":
        """From an engine.request.RequestTimes (duck-typed: this module imports no engine code)."""
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
                   recomputed_n=t.recomputed_n or None)


FinishReason = Literal["stop", "length", "cancelled", "error"]
