"""-pp through HTTP: three stages in worker processes (gloo over loopback) with trees of drafts give
the same greedy tokens as one process, for two slots at once; the draft on a rank of its own
samples repeatably and its loss loses no request; a worker that dies or hangs fails the stream
with an error naming its stage and turns /health non-200 within 10 s; the head takes its workers
with it, however it ends. The other shapes across stages are cells of tests/server/test_combinations.py."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from bench.processes import ServerProcess, alive, descendants, free_port, wait_until
from engine.threads import stat_fields
from tests.engine.test_qsa_engine import write_llama8_with_drafts
from tests.server.helpers import ROOT, sse_events

COMMON = ["-np", "2", "-c", "512"]
PROMPTS = ["the tide comes in and the tide goes out, and the shore keeps every shell the tide leaves behind",
           "a lantern in the window of the harbour master's house, lit every night for forty years"]
LOSS_BOUND_S = 10.0  # a lost stage is reported within this


@pytest.fixture(scope="module")
def llama8(tmp_path_factory):
    """An eight-layer tiny Llama (4 layers per stage) and an untrained MTP draft for it."""
    return write_llama8_with_drafts(tmp_path_factory.mktemp("llama8"))


def complete_both(server) -> list[dict]:
    bodies = [{"prompt": p, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "cache_prompt": False,
               "logprobs": 1} for p in PROMPTS]
    with server.client() as c, ThreadPoolExecutor(2) as pool:
        responses = list(pool.map(lambda body: c.post("/v1/completions", json=body), bodies))
    assert [r.status_code for r in responses] == [200, 200], [r.text for r in responses]
    return [r.json()["choices"][0] | {"timings": r.json()["timings"]} for r in responses]


@pytest.fixture(scope="module")
def one_process(start_server, llama8):
    server = start_server(["-m", str(llama8), *COMMON])
    try:
        return complete_both(server)
    finally:
        server.kill()


# --spec-max-batch 0: both slots draft while both decode (the server pauses drafts past one by default).
MTP = ["--spec-type", "draft-mtp", "--spec-draft-p-min", "0", "--spec-max-batch", "0"]
# Trees of siblings: a kept sibling's K/V move travels to every stage with the next micro-batch
# (the target with noise on its weights drafts: its trees keep siblings, an untrained MTP's do not).
TREES = ["--spec-type", "draft-simple", "--spec-draft-p-min", "0", "--spec-max-batch", "0", "--spec-draft-width", "3",
         "--spec-draft-p-sibling", "0"]


def siblings_kept(server) -> int:
    with server.client() as c:
        return int(re.search(r"^tandem:draft_siblings_kept_total (\d+)$", c.get("/metrics").text, re.M).group(1))


def test_three_stages_with_trees_give_the_tokens_of_one_process(start_server, llama8, one_process):
    layers = [[0, 2], [2, 5], [5, 8]]
    server = start_server(["-m", str(llama8), *COMMON, "-pp", "3", "--layer-split", "2,3,3", "--pipeline-depth", "2",
                           *TREES, "-md", str(llama8 / "noisy")])
    try:
        got = complete_both(server)
        with server.client() as c:
            props = c.get("/props").json()
            probes = [c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2, "attention_probe": {
                "layers": [layer], "kind": "head_mean", "query": "last"}}) for layer in (0, layers[-1][0])]
        log = server.log_text()
        kept = siblings_kept(server)
    finally:
        server.kill()
    assert kept > 0, "no sibling was kept: no move crossed the stages"
    for mine, theirs in zip(got, one_process):
        assert mine["text"] == theirs["text"]
        assert mine["logprobs"]["token_logprobs"] == pytest.approx(theirs["logprobs"]["token_logprobs"], abs=1e-4)
    # Drafts were verified and some rejected: the cache rolled back on every stage.
    assert all(r["timings"]["draft_n"] > r["timings"]["draft_n_accepted"] for r in got)
    assert props["stages"] == len(layers) and props["pipeline_depth"] == 2
    assert props["pipeline_stages"] == [{"rank": r, "device": "cpu", "layers": span} for r, span in enumerate(layers)]
    last = len(layers) - 1
    assert f"pipeline stage {last} (rank {last} of {len(layers)}): layers {layers[-1][0]}..7 on cpu loaded" in log
    # The head's own layers can be probed; a worker's are refused, naming the field and the rule.
    assert probes[0].status_code == 200 and probes[0].json()["attention_probe"]
    assert probes[1].status_code == 400
    message = probes[1].json()["error"]["message"]
    assert "attention_probe.layers" in message and "probes need a single process" in message


def test_the_draft_on_its_own_rank_samples_repeatably_and_losing_it_loses_no_request(start_server, llama8,
                                                                                     one_process):
    # Without pacing, whose timing-based pauses would change which steps draw drafts.
    server = start_server(["-m", str(llama8), *COMMON, *MTP, "-md", str(llama8 / "draft.safetensors"),
                           "--spec-draft-rank", "--no-spec-pacing"])
    try:
        body = {"prompt": PROMPTS[0], "max_tokens": 30, "temperature": 0.9, "seed": 7, "ignore_eos": True,
                "cache_prompt": False}
        with server.client() as c:
            sampled = [c.post("/v1/completions", json=body).json() for _ in range(2)]
        # The draft's distributions travel back whole: a seeded request repeats, drafts and all.
        assert sampled[0]["choices"][0]["text"] == sampled[1]["choices"][0]["text"]
        assert sampled[0]["timings"]["draft_n"] > 0
        draft = worker_of(server)
        os.kill(draft, signal.SIGKILL)
        wait_until(lambda: not alive(draft), 10, "the draft rank's exit")
        after = complete_both(server)  # greedy: the tokens of one process without the draft
        log = server.log_text()
    finally:
        server.kill()
    assert [r["text"] for r in after] == [r["text"] for r in one_process]
    assert f"the draft (rank 1, pid {draft}) killed by signal 9; requests go on without drafts" in log


def workers_of(server) -> list[int]:
    """The head's worker processes: its children running the server (not, say, a compiler the CPU
    kernels' build check starts)."""
    def is_worker(pid: int) -> bool:
        fields = stat_fields(pid)
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                return fields is not None and int(fields[1]) == server.proc.pid and b"-m\0server\0" in f.read()
        except OSError:
            return False
    return [pid for pid in descendants(server.proc.pid) if is_worker(pid)]


def worker_of(server) -> int:
    workers = wait_until(lambda: workers_of(server), 60, "the head's worker process")  # a loaded machine
    assert len(workers) == 1, workers
    return workers[0]


def stream_until_failure(server, fail_worker) -> tuple[dict, float]:
    """Starts a long stream, calls fail_worker() once tokens flow, and returns the stream's error
    event and the seconds from the failure to that event."""
    body = {"prompt": PROMPTS[0], "max_tokens": 4000, "temperature": 0, "ignore_eos": True, "stream": True}
    with server.client(timeout=30) as c, c.stream("POST", "/v1/completions", json=body) as r:
        failed_at = None
        for event in sse_events(r):
            if "error" in event:
                return event, time.monotonic() - failed_at
            if failed_at is None:
                fail_worker()
                failed_at = time.monotonic()
    raise AssertionError("the stream ended without an error event")


def assert_unhealthy(server, words: str) -> None:
    def unhealthy():
        r = httpx.get(server.url + "/health", timeout=2)
        return r if r.status_code != 200 else None
    r = wait_until(unhealthy, LOSS_BOUND_S, "/health to fail")
    assert r.status_code == 500 and words in r.json()["error"]["message"], r.text


def test_a_killed_worker_fails_the_stream_and_health_naming_its_stage(start_server, llama8):
    server = start_server(["-m", str(llama8), "-c", "8192", "-pp", "2"])
    try:
        worker = worker_of(server)
        event, seconds = stream_until_failure(server, lambda: os.kill(worker, signal.SIGKILL))
        assert seconds < LOSS_BOUND_S and event["error"]["code"] == 500
        assert "pipeline stage 1 (rank 1" in event["error"]["message"] and "killed by signal 9" in event["error"]["message"]
        assert_unhealthy(server, "pipeline stage 1 (rank 1")
        with server.client() as c:  # nothing hangs: a new request fails at once
            r = c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=LOSS_BOUND_S)
        assert r.status_code == 500 and "pipeline stage 1" in r.json()["error"]["message"]
    finally:
        server.kill()


def test_a_hung_worker_fails_the_stream_within_the_pipeline_timeout(start_server, llama8):
    server = start_server(["-m", str(llama8), "-c", "8192", "-pp", "2", "--pipeline-timeout", "2"])
    worker = worker_of(server)
    try:
        event, seconds = stream_until_failure(server, lambda: os.kill(worker, signal.SIGSTOP))
        assert seconds < LOSS_BOUND_S and event["error"]["code"] == 500
        assert "pipeline stage 1 (rank 1) lost" in event["error"]["message"], event
        assert_unhealthy(server, "pipeline stage 1")
    finally:
        os.kill(worker, signal.SIGKILL)
        server.kill()


def test_a_worker_lost_while_loading_fails_the_load(start_server, llama8):
    server = start_server(["-m", str(llama8), "-pp", "2"], wait=False)
    os.kill(worker_of(server), signal.SIGKILL)
    assert server.proc.wait(30) == 1
    assert "model load failed: pipeline stage 1 (rank 1, pid" in server.log_text()


def test_sigkill_of_the_head_takes_its_workers(start_server, llama8):
    server = start_server(["-m", str(llama8), "-pp", "3"])
    workers = workers_of(server)
    assert len(workers) == 2 and all(alive(p) for p in workers)
    server.proc.kill()
    server.proc.wait(10)
    wait_until(lambda: not any(alive(p) for p in workers), LOSS_BOUND_S, "the workers to die with the head")


def test_sigterm_on_the_head_stops_its_workers(start_server, llama8):
    server = start_server(["-m", str(llama8), "-pp", "2"])
    worker = worker_of(server)
    server.terminate()
    assert server.proc.wait(30) == 0
    assert not alive(worker)
    assert "pipeline stage 1: stopped by the head" in server.log_text()


def test_torchrun_ranks_serve_and_a_worker_exits_soon_after_losing_its_head(llama8, tmp_path):
    """Ranks as torchrun starts them: the same command line with RANK, WORLD_SIZE, MASTER_ADDR and
    MASTER_PORT; rank 0 serves HTTP. The worker is not the head's child here: it must notice the
    lost head by itself."""
    master = {"WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    args = ["-m", str(llama8), "-pp", "2", "-t", "1"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), **master}
    with open(tmp_path / "worker.log", "w") as log:
        worker = subprocess.Popen([sys.executable, "-m", "server", *args], cwd=ROOT, env={**env, "RANK": "1"},
                                  stdout=log, stderr=subprocess.STDOUT)
    head = ServerProcess(args, tmp_path / "head.log", env={**master, "RANK": "0"})
    try:
        head.wait_ready()
        assert workers_of(head) == []  # torchrun started the worker, not the head
        with head.client() as c:
            r = c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
        head.proc.kill()
        head.proc.wait(10)
        assert worker.wait(LOSS_BOUND_S) != 0
    finally:
        head.kill()
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)
