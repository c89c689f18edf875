"""`python -m bench` against a real tiny-model server process with two slots."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

import httpx
import pytest

from bench.client import completion_body, stream_completion, tokenize
from bench.records import INTERRUPTED, read_jsonl
from bench.session import Session
from bench.workload import Workload
from tests.server.helpers import ROOT

PROMPT, GEN, LANES, RUNS = 64, 32, 2, 2
WARMUP_GEN = 16


def bench_cmd(url: str, out, *extra: str) -> list[str]:
    return [sys.executable, "-m", "bench", "--url", url, "--model", "tiny", "--prompt-tokens", str(PROMPT),
            "--gen-tokens", str(GEN), "--lanes", str(LANES), "--out", str(out), "--json", *extra]


def counters(server) -> dict[str, float]:
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    return {k: float(v) for k, v in (line.split() for line in text.splitlines() if line.startswith("tandem:"))}


@pytest.fixture(scope="module")
def cli_session(tiny_server, tmp_path_factory):
    """One session, the first on this server (no slot holds an earlier session's prompt), with the
    server's counters around it."""
    tmp = tmp_path_factory.mktemp("bench")
    before = counters(tiny_server)
    done = subprocess.run(bench_cmd(tiny_server.url, tmp / "r.jsonl", "--runs", str(RUNS), "--plot", str(tmp / "p.png")),
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    delta = {k: v - before.get(k, 0.0) for k, v in counters(tiny_server).items()}
    return SimpleNamespace(summary=json.loads(done.stdout), records=read_jsonl(tmp / "r.jsonl"), delta=delta,
                           png=tmp / "p.png")


def test_records_are_valid_and_match_the_server_counts(cli_session):
    records = cli_session.records
    assert len(records) == LANES * RUNS and all(r.valid for r in records)
    for r in records:
        assert (r.cache_n, r.prompt_n, r.predicted_n) == (0, PROMPT, GEN)
        assert (r.usage_prompt_tokens, r.usage_completion_tokens) == (PROMPT, GEN)
        assert len(r.itl_ms) == GEN - 1  # one chunk per token: no drafting on this server
        assert 0 < r.ttft_ms < r.e2e_ms
    # The server's own counters, warm-up included: every prompt processed whole, nothing reused.
    d = cli_session.delta
    assert d["tandem:requests_total"] == LANES * RUNS + 1
    assert d["tandem:prompt_tokens_total"] == (LANES * RUNS + 1) * PROMPT
    assert d["tandem:prompt_tokens_cached_total"] == 0
    assert d["tandem:tokens_predicted_total"] == LANES * RUNS * GEN + WARMUP_GEN


def test_lanes_run_concurrently_on_the_server(cli_session):
    for run in range(RUNS):
        lanes = [r for r in cli_session.records if r.run == run]
        assert sorted(r.lane for r in lanes) == list(range(LANES))
        # Every lane had its first token before any lane finished: both slots were generating.
        assert max(r.start_s + r.ttft_ms / 1000 for r in lanes) < min(r.end_s for r in lanes)


def test_summary_figures_are_computed_from_the_records(cli_session):
    records, summary = cli_session.records, cli_session.summary
    assert summary["records"] == summary["valid"] == LANES * RUNS and not summary["interrupted"]
    overall = summary["scopes"][-1]
    assert overall["tg"]["median"] == pytest.approx(statistics.median(r.predicted_per_second for r in records))
    assert overall["pp"]["max"] == pytest.approx(max(r.prompt_per_second for r in records))
    for lane, scope in enumerate(summary["scopes"][:-1]):
        assert scope["tg"]["median"] == pytest.approx(
            statistics.median(r.predicted_per_second for r in records if r.lane == lane))
    for row in summary["rounds"]:
        lanes = [r for r in records if r.run == row["run"]]
        wall = max(r.end_s for r in lanes) - min(r.start_s for r in lanes)
        assert row["aggregate_tg"] == pytest.approx(LANES * GEN / wall)
    assert cli_session.png.read_bytes()[:4] == b"\x89PNG"


def test_a_prompt_sharing_a_cached_prefix_gives_an_invalid_record(tiny_server, cli_session):
    """After the CLI session, so its prompts never met this one's in a slot."""
    workload = Workload(prompt_tokens=48, gen_tokens=8, lanes=1, runs=1)

    async def twice():
        async with httpx.AsyncClient(base_url=tiny_server.url, timeout=60) as http:
            ids = (await tokenize(http, "Shared prefix, then something else entirely. " * 3, "tiny"))[:40]
            first = await stream_completion(http, completion_body("tiny", ids, 8, workload), 0, 0, time.perf_counter())
            again = ids + list(b"12345678")
            return first, await stream_completion(http, completion_body("tiny", again, 8, workload), 0, 1,
                                                  time.perf_counter())

    _, second = asyncio.run(twice())
    assert second.cache_n >= 40 and not second.valid
    assert second.invalid_reason.startswith(f"cache_n={second.cache_n}: prompt tokens reused from the cache")


def test_ctrl_c_keeps_every_record_and_marks_the_summary(fresh_tiny_server, tmp_path):
    out = tmp_path / "r.jsonl"
    # 31 prompts: the byte tokenizer's pseudo-word text has about 44 distinct first tokens to give.
    proc = subprocess.Popen(bench_cmd(fresh_tiny_server.url, out, "--runs", "15"), cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not (out.exists() and len(out.read_text().splitlines()) >= 2):
            assert proc.poll() is None, proc.stderr.read()
            assert time.monotonic() < deadline, "no record after 120 s"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert proc.returncode == 130, stderr
    summary, records = json.loads(stdout), read_jsonl(out)
    assert summary["interrupted"] and summary["records"] == len(records) < 30
    assert all(r.valid or r.invalid_reason == INTERRUPTED for r in records), [r.invalid_reason for r in records]
    assert summary["invalid"] in ({}, {INTERRUPTED: len(records) - summary["valid"]})


def test_an_interrupt_before_a_rounds_requests_start_ends_the_session_cleanly(tiny_server):
    """Ctrl-C can land after a round's lanes are scheduled and before any of them runs: those
    requests were never sent, so they leave no record, and the session still ends as interrupted
    instead of raising CancelledError out of run()."""
    async def interrupt_at_round_start():
        async with Session(tiny_server.url, "tiny", Workload(PROMPT, 4, lanes=2, runs=3)) as session:
            await session.prepare()
            runner = asyncio.create_task(session.run())
            while not session._tasks:  # run() has scheduled round 0; no lane has taken a step
                await asyncio.sleep(0)
            session.interrupt()
            return session, await asyncio.wait_for(runner, 60)

    session, records = asyncio.run(interrupt_at_round_start())
    assert session.interrupted and records == []
