"""The server as the benchmark sees it: its model list, /tokenize, and one streamed completion
timed chunk by chunk into a Record. Request and response shapes are server.protocol's."""
from __future__ import annotations

import json
import time

import httpx
from pydantic import ValidationError

from bench.records import Record
from bench.workload import FixtureError, Workload
from server.protocol import CompletionRequest, StreamOptions, Timings, TokenizeRequest, Usage


async def served_models(http: httpx.AsyncClient) -> list[str] | None:
    """The ids /v1/models lists; None when the server has no such endpoint."""
    response = await _preflight(http, "GET", "/v1/models")
    if response.status_code == 404:
        return None
    return [m["id"] for m in _json(response, "/v1/models").get("data", [])]


async def tokenize(http: httpx.AsyncClient, text: str, model: str) -> list[int]:
    # `model` routes the call through a proxy that serves several; a server ignores it.
    body = {**TokenizeRequest(content=text, add_special=False).model_dump(), "model": model}
    response = await _preflight(http, "POST", "/tokenize", json=body)
    return _json(response, "/tokenize")["tokens"]


async def _preflight(http: httpx.AsyncClient, method: str, path: str, **kwargs) -> httpx.Response:
    try:
        return await http.request(method, path, **kwargs)
    except httpx.TransportError as e:
        raise FixtureError(f"{http.base_url}{path}: server unreachable ({type(e).__name__}: {e})") from e


def _json(response: httpx.Response, what: str) -> dict:
    if response.status_code != 200:
        raise FixtureError(f"{what}: HTTP {response.status_code}: {error_message(response.text)}")
    try:
        return response.json()
    except ValueError as e:
        raise FixtureError(f"{what}: not JSON: {response.text[:200]!r}") from e


def error_message(text: str) -> str:
    """The message of an OpenAI-shaped error body, else the body itself (shortened)."""
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:300]


def completion_body(model: str, prompt_ids: list[int], gen_tokens: int, workload: Workload) -> dict:
    """Exactly gen_tokens new tokens (ignore_eos, max_tokens); the prompt cache stays on, as a
    server runs in practice: the prompts' fresh prefixes are what keep it from helping."""
    request = CompletionRequest(model=model, prompt=prompt_ids, max_tokens=gen_tokens, ignore_eos=True,
                                temperature=workload.temperature, seed=workload.seed, stream=True,
                                stream_options=StreamOptions(include_usage=True))
    return request.model_dump(exclude_unset=True)


async def stream_completion(http: httpx.AsyncClient, body: dict, lane: int, run: int, t0: float) -> Record:
    """Sends `body` (a streaming /v1/completions request) and times its chunks. Every outcome is a
    Record: failures leave `error` set. t0 is the session's perf_counter origin for start_s/end_s."""
    sent = time.perf_counter()
    record = Record(lane=lane, run=run, prompt_tokens=len(body["prompt"]), gen_tokens=body["max_tokens"],
                    start_s=sent - t0)
    token_times: list[float] = []
    final: dict = {}
    try:
        async with http.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {error_message((await response.aread()).decode())}"
            else:
                async for chunk in _sse_chunks(response):
                    if "error" in chunk:
                        record.error = f"error in stream: {error_message(json.dumps(chunk))}"
                        break
                    choices = chunk.get("choices") or []
                    # A chunk with a choice and no finish_reason carries tokens (its text may be empty
                    # while the server holds back an incomplete UTF-8 character).
                    if choices and choices[0].get("finish_reason") is None:
                        token_times.append(time.perf_counter())
                    elif choices:
                        record.finish_reason = choices[0]["finish_reason"]
                    final.update({k: chunk[k] for k in ("usage", "timings") if chunk.get(k)})
    except httpx.HTTPError as e:
        record.error = f"stream cut: {type(e).__name__}: {e}"
    except ValueError as e:
        record.error = f"malformed chunk: {e}"
    end = time.perf_counter()
    record.end_s, record.e2e_ms = end - t0, 1000.0 * (end - sent)
    if token_times:
        record.ttft_ms = 1000.0 * (token_times[0] - sent)
        record.itl_ms = [1000.0 * (b - a) for a, b in zip(token_times, token_times[1:])]
    if record.error is None:
        _apply_counts(record, final, token_times)
    return record


async def _sse_chunks(response: httpx.Response):
    """JSON payloads of an SSE stream, up to `[DONE]` or the end of the stream."""
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)


def _apply_counts(record: Record, final: dict, token_times: list[float]) -> None:
    """Counts and rates from the server's `timings`; without them, from `usage` and arrival times."""
    try:
        usage = Usage.model_validate(final["usage"])
        timings = Timings.model_validate(final["timings"]) if "timings" in final else None
    except (KeyError, ValidationError) as e:
        record.error = f"final chunk without a usable usage/timings: {e}"
        return
    record.usage_prompt_tokens, record.usage_completion_tokens = usage.prompt_tokens, usage.completion_tokens
    if timings is not None:
        record.timings_source = "server"
        record.cache_n, record.prompt_n, record.predicted_n = timings.cache_n, timings.prompt_n, timings.predicted_n
        record.prompt_per_second, record.predicted_per_second = timings.prompt_per_second, timings.predicted_per_second
        record.draft_n, record.draft_n_accepted = timings.draft_n, timings.draft_n_accepted
        return
    record.timings_source = "client"
    record.prompt_n, record.predicted_n = usage.prompt_tokens, usage.completion_tokens
    if record.ttft_ms:
        record.prompt_per_second = 1000.0 * usage.prompt_tokens / record.ttft_ms
    if len(token_times) > 1:
        # As llama-server counts it: every generated token over the time from the first to the last.
        record.predicted_per_second = usage.completion_tokens / (token_times[-1] - token_times[0])
