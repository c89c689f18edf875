"""Servers compared over HTTP, as a user meets them: tandem's `python -m server` and llama.cpp's
own C++ `llama-server` (or, as a labelled fallback, llama-cpp-python's `python -m
llama_cpp.server`), each a real process on a free loopback port, sent the same prompt text on
/v1/completions and timed from its streamed chunks.

TG of one request: (tokens - 1) / (arrival of the last chunk - arrival of the first), so the prompt
is not in it; `lanes` requests at once give the aggregate TG of that many slots. The token count is
the server's own: tandem's `timings.predicted_n` (a chunk may carry several accepted tokens),
llama.cpp's one token per chunk before the finishing one (checked against its non-streamed usage when it starts).
"""
from __future__ import annotations

import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from bench.processes import ServerProcess, free_port, sse_events, wait_answering


@dataclass
class Sample:
    tokens: int  # generated tokens, all lanes
    seconds: float  # first chunk to last, summed over lanes
    drafted: int = 0
    accepted: int = 0
    prompt_tokens: int = 0  # prompt tokens the server reports it processed (not taken from its cache)
    prompt_seconds: float = 0.0  # request sent to first chunk, summed over those streams

    @property
    def tg(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def pp(self) -> float:
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    def add(self, other: "Sample") -> None:
        self.tokens += other.tokens
        self.seconds += other.seconds
        self.drafted += other.drafted
        self.accepted += other.accepted
        self.prompt_tokens += other.prompt_tokens
        self.prompt_seconds += other.prompt_seconds


@dataclass
class Series:
    system: str
    tg: list[float] = field(default_factory=list)  # one per run: TG over all the run's prompts
    drafted: int = 0
    accepted: int = 0
    pp: list[float] = field(default_factory=list)  # one per run, where the server reports its prompt tokens

    @property
    def tg_median(self) -> float:
        return statistics.median(self.tg)

    @property
    def pp_median(self) -> float:
        return statistics.median(self.pp) if self.pp else 0.0


class TandemServer:
    def __init__(self, name: str, args: list[str], threads: int, log_dir: Path):
        self.name = name
        # A name can hold a draft's path: the log's file name keeps only what a file name can.
        log = re.sub(r"[^\w.+-]+", "_", name)
        self.process = ServerProcess(args, log_dir / f"{log}.log", threads=threads)

    def start(self) -> None:
        self.process.wait_ready()
        self.url = self.process.url

    def body(self, text: str, max_tokens: int, temperature: float, seed: int) -> dict:
        return {"prompt": text, "max_tokens": max_tokens, "temperature": temperature, "seed": seed, "stream": True}

    def count(self, chunks: list[dict]) -> tuple[int, int, int, int]:
        """(tokens, drafted, accepted, prompt tokens processed) of one finished stream."""
        t = chunks[-1].get("timings") or {}
        return t.get("predicted_n", 0), t.get("draft_n", 0), t.get("draft_n_accepted", 0), t.get("prompt_n", 0)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.proc.wait(timeout=30)
        finally:
            self.process.kill()


class _LlamaCpp:
    """What llama.cpp's two servers share: the request body, the token count, the stop."""

    name: str

    def _spawn(self, argv: list[str], log_dir: Path, log_name: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_dir / log_name, "w")
        self.proc = subprocess.Popen([*argv, "--host", "127.0.0.1", "--port", str(self.port)], stdout=self.log,
                                     stderr=subprocess.STDOUT)

    def start(self) -> None:
        wait_answering(self.proc, self.url + "/v1/models", lambda: Path(self.log.name).read_text()[-4000:])
        self._check_one_token_per_chunk()

    def body(self, text: str, max_tokens: int, temperature: float, seed: int) -> dict:
        # Greedy as tandem's temperature 0: top-k 1, no other filter.
        extra = {"top_k": 1, "top_p": 1.0, "min_p": 0.0} if temperature == 0 else {"top_k": 0, "top_p": 1.0, "min_p": 0.0}
        return {"prompt": text, "max_tokens": max_tokens, "temperature": temperature, "seed": seed, "stream": True,
                "repeat_penalty": 1.0, **extra}

    def count(self, chunks: list[dict]) -> tuple[int, int, int, int]:
        # One chunk per token, then one with the finish reason and no token, which carries the
        # C++ server's timings (the Python server's has none).
        t = chunks[-1].get("timings") or {}
        return sum(c["choices"][0].get("finish_reason") is None for c in chunks), 0, 0, t.get("prompt_n", 0)

    def _check_one_token_per_chunk(self) -> None:
        body = self.body("The capital of France is", 16, 0.0, 0)
        with httpx.Client(base_url=self.url, timeout=120) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                chunks = [c for c in sse_events(r) if c.get("choices")]
            usage = http.post("/v1/completions", json={**body, "stream": False}).json()["usage"]
        counted = self.count(chunks)[0]
        if counted != usage["completion_tokens"]:
            raise RuntimeError(f"{self.name} streamed {counted} token chunks for {usage['completion_tokens']} tokens: "
                               "its chunks cannot count tokens")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self.log.close()


class LlamaServer(_LlamaCpp):
    """llama.cpp's own C++ `llama-server` on the same GGUF file: the anchor. Built from the
    llama.cpp source inside llama-cpp-python's sdist (docs/benchmarks.md, "The anchor")."""

    NAME = "llama-server"

    def __init__(self, binary: Path, gguf: Path, ctx: int, parallel: int, threads: int, log_dir: Path):
        self.name = self.NAME
        unified = ["--kv-unified"] if parallel > 1 else []
        self._spawn([str(binary), "-m", str(gguf), "-c", str(ctx * parallel), "-np", str(parallel), *unified,
                     "-t", str(threads), "-tb", str(threads), "-b", "512", "--no-webui"], log_dir, "llama_server.log")


class LlamaCppServer(_LlamaCpp):
    """llama-cpp-python's OpenAI-style server on the same GGUF file (`pip install
    "llama-cpp-python[server]"`: it compiles llama.cpp natively, which takes minutes). A fallback
    where the C++ server is not built: its Python layer makes it slower than llama-server."""

    NAME = "llama-cpp-python server (fallback)"

    def __init__(self, gguf: Path, ctx: int, parallel: int, threads: int, log_dir: Path):
        self.name = self.NAME
        # llama-cpp-python serves one request at a time per model: lanes beyond one queue there.
        self._spawn([sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--n_ctx", str(ctx * parallel),
                     "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_batch", "512",
                     "--verbose", "False"], log_dir, "llama_cpp.log")


class Constrained:
    """A started server again, each answer held to a grammar: `fields` (llama-server's
    {"json_schema": schema} or {"grammar": GBNF}, which tandem reads too) added to every request;
    started and stopped as the server it wraps, and named after it with `label` in brackets."""

    def __init__(self, server, fields: dict, label: str):
        self.server, self.fields, self.name = server, fields, f"{server.name} [{label}]"

    @property
    def url(self) -> str:
        return self.server.url

    def body(self, text: str, max_tokens: int, temperature: float, seed: int) -> dict:
        return {**self.server.body(text, max_tokens, temperature, seed), **self.fields}

    def count(self, chunks: list[dict]) -> tuple[int, int, int, int]:
        return self.server.count(chunks)

    def stop(self) -> None:
        """The server it wraps is stopped as itself."""


def one_stream(server, text: str, max_tokens: int, temperature: float,
               seed: int) -> tuple[float, float, float, tuple]:
    """(sending, arrival of the first chunk, of the last, the server's count())."""
    stamps, chunks = [], []
    with httpx.Client(base_url=server.url, timeout=600) as http:
        sent = time.perf_counter()
        with http.stream("POST", "/v1/completions", json=server.body(text, max_tokens, temperature, seed)) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"{server.name}: HTTP {r.status_code}: {r.text[:300]}")
            for chunk in sse_events(r):
                if chunk.get("choices"):
                    stamps.append(time.perf_counter())
                    chunks.append(chunk)
    return sent, stamps[0], stamps[-1], server.count(chunks)


def measure(server, texts: list[str], max_tokens: int, temperature: float, lanes: int, seed: int) -> Sample:
    """Each text once, `lanes` streams at a time. A group's TG: its tokens after each stream's first
    (which comes out of the prefill) over the time from the first stream's first chunk to the last
    stream's last; with one lane, TG at batch 1. PP: the prompt tokens the servers report over
    each stream's wait for its first chunk (the prompt's prefill and one decode step)."""
    total = Sample(0, 0.0)
    with ThreadPoolExecutor(lanes) as pool:
        for i in range(0, len(texts), lanes):
            runs = list(pool.map(lambda t: one_stream(server, t, max_tokens, temperature, seed), texts[i:i + lanes]))
            total.seconds += max(last for _, _, last, _ in runs) - min(first for _, first, _, _ in runs)
            for sent, first, _, (tokens, drafted, accepted, prompt) in runs:
                total.tokens += max(tokens - 1, 0)
                total.drafted += drafted
                total.accepted += accepted
                if prompt:
                    total.prompt_tokens += prompt
                    total.prompt_seconds += first - sent
    return total
