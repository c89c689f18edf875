"""A fake OpenAI-style server on loopback whose counts the test chooses: a reused cache prefix, a
short generation, no `timings`, an extra BOS, HTTP errors. It stands in for a misbehaving or
different server; the benchmark client is what is under test.

Its tokenizer is one token per UTF-8 byte, like the tiny models'."""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import uvicorn
from fastapi import FastAPI
from fastapi.responses import JSONResponse, StreamingResponse

from bench.processes import free_port
from server.protocol import CompletionRequest, TokenizeRequest, error_body

MODEL = "fake"


@dataclass
class Mode:
    cache_n: int = 0  # prompt tokens reported as reused
    short_by: int = 0  # tokens fewer than max_tokens, ending with finish_reason "stop"
    timings: bool = True  # False: usage only, as servers without llama-server's extension
    extra_prompt_tokens: int = 0  # counted on top of the ids sent (a server adding a BOS)
    fail_from: int | None = None  # completion requests from this index on answer HTTP 500
    tokens_per_word: float | None = None  # /tokenize merges words: fewer tokens than bytes


@dataclass
class FakeUpstream:
    url: str = ""
    mode: Mode = field(default_factory=Mode)
    completions: int = 0  # completion requests received, warm-up included

    def app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/v1/models")
        async def models():
            return {"object": "list", "data": [{"id": MODEL, "object": "model"}]}

        @app.post("/tokenize")
        async def tokenize(body: TokenizeRequest):
            ids = list(body.content.encode())
            if self.mode.tokens_per_word is not None:
                ids = ids[:int(len(body.content.split()) * self.mode.tokens_per_word)]
            return {"tokens": ids}

        @app.post("/v1/completions")
        async def completions(body: CompletionRequest):
            index, self.completions = self.completions, self.completions + 1
            if self.mode.fail_from is not None and index >= self.mode.fail_from:
                return JSONResponse(error_body(500, "the fake engine failed"), status_code=500)
            return StreamingResponse(self._stream(body), media_type="text/event-stream")

        return app

    async def _stream(self, body: CompletionRequest):
        m = self.mode
        n_prompt = len(body.prompt) + m.extra_prompt_tokens
        n_gen = body.max_tokens - m.short_by
        started = time.perf_counter()
        for _ in range(n_gen):
            yield _event({"choices": [{"index": 0, "text": "x", "finish_reason": None}]})
        final = {"choices": [{"index": 0, "text": "", "finish_reason": "stop" if m.short_by else "length"}],
                 "usage": {"prompt_tokens": n_prompt, "completion_tokens": n_gen, "total_tokens": n_prompt + n_gen}}
        if m.timings:
            ms = max(1000.0 * (time.perf_counter() - started), 1e-3)
            final["timings"] = {"cache_n": m.cache_n, "prompt_n": n_prompt - m.cache_n, "prompt_ms": ms,
                                "prompt_per_token_ms": ms / n_prompt, "prompt_per_second": 1000.0 * n_prompt / ms,
                                "predicted_n": n_gen, "predicted_ms": ms, "predicted_per_token_ms": ms / n_gen,
                                "predicted_per_second": 1000.0 * n_gen / ms}
        yield _event(final)
        yield "data: [DONE]\n\n"


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"


class Running:
    """uvicorn serving a FakeUpstream in a thread; stop() ends it within a bounded wait."""

    def __init__(self, fake: FakeUpstream, timeout: float = 30.0):
        port = free_port()
        fake.url = f"http://127.0.0.1:{port}"
        self.server = uvicorn.Server(uvicorn.Config(fake.app(), host="127.0.0.1", port=port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                self.stop()
                raise TimeoutError(f"fake upstream not serving after {timeout} s")
            time.sleep(0.05)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
