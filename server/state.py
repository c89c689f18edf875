"""ServerSettings (from the command line) and ServerState (what the app's handlers share)."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from server.flags import DEFAULT_BODY_LIMIT
from server.metrics import Metrics
from server.protocol import APIError
from server.runner import EngineRunner
from server.tokenizing import PromptTokenizer


@dataclass(frozen=True)
class ServerSettings:
    host: str = "127.0.0.1"
    port: int = 8080
    alias: str | None = None
    api_key: str | None = None
    body_limit: int = DEFAULT_BODY_LIMIT  # bytes of a request body
    drain_timeout: float = 60.0  # seconds in-flight requests get to finish after SIGTERM
    queue_limit: int | None = None  # requests that may wait beyond the busy slots; None: unbounded
    timeout: float | None = None  # seconds a generation may take from its arrival; None: no limit
    stream_interval: float = 0.02  # seconds between two chunks of one stream, after its first (server.runner)


@dataclass
class ServerState:
    settings: ServerSettings
    runner: EngineRunner
    metrics: Metrics = field(default_factory=Metrics)
    draining: bool = False
    in_flight: int = 0  # HTTP requests being answered (streams count until their last byte)
    completions: int = 0  # of those, completion requests (the queue limit counts them)

    @cached_property
    def prompts(self) -> PromptTokenizer:
        """Once the model is loaded (the handlers check that first)."""
        engine = self.runner.engine
        return PromptTokenizer(engine.tokenizer, engine.config.ctx_per_slot)

    @property
    def model_name(self) -> str:
        return self.settings.alias or self.runner.config.model or "default"

    def check_model(self, requested: str | None) -> None:
        """With --alias NAME, only NAME and "default" are served; without it, any name."""
        alias = self.settings.alias
        if alias and requested and requested not in (alias, "default"):
            raise APIError(404, f"model={requested!r}: this server serves {alias!r}", "not_found_error")
