"""Through one proxy to one 2-slot tiny-model server: jobs, streaming, slots, disconnects, clients."""
from __future__ import annotations

import concurrent.futures
import json
import os
import socket
import threading
import time

import httpx
import pytest

from bench.processes import alive, wait_until
from proxy.cores import split
from tests.proxy.conftest import LONG_STREAM, sse_events, tiny_profile

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Say something."}], "temperature": 0,
        "max_tokens": 12, "stream": True}


@pytest.fixture(scope="module")
def proxy(make_proxy, tiny_model):
    # twins: two replicas, their threads left to the CPUs the proxy gives them (no -t)
    twins = {"args": ["-m", str(tiny_model), "-c", "512", "-np", "1"], "replicas": 2, "health_timeout": 90}
    p = make_proxy({"tiny": tiny_profile(tiny_model), "spare": tiny_profile(tiny_model),
                    "never": tiny_profile(tiny_model), "twins": twins})
    p.load_job = p.job("load", "tiny")
    return p


def chat_stream(url: str, body: dict, headers: dict | None = None) -> list:
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["x-accel-buffering"] == "no"
        return sse_events(r.iter_lines())


def text_of(events: list) -> str:
    return "".join(e["choices"][0]["delta"].get("content") or "" for e in events if isinstance(e, dict))


def test_load_job_succeeds_and_reports_its_duration(proxy):
    job = proxy.load_job
    assert job["status"] == "succeeded" and job["type"] == "load" and job["error"] is None
    assert job["duration_s"] > 0 and "loaded 1 replica" in job["message"]
    [replica] = proxy.replicas("tiny")
    assert replica["state"] == "ready" and replica["slots_total"] == 2 and alive(replica["pid"])
    models = {m["id"]: m["status"]["value"] for m in proxy.client.get("/v1/models").json()["data"]}
    assert models == {"tiny": "ready", "spare": "unloaded", "never": "unloaded", "twins": "unloaded"}


def test_streaming_chat_through_the_proxy_equals_the_servers_own_answer(proxy):
    direct = chat_stream(f"http://127.0.0.1:{proxy.replicas('tiny')[0]['port']}", CHAT)
    relayed = chat_stream(proxy.url, CHAT)
    assert text_of(relayed) == text_of(direct) and relayed[-1] == "[DONE]"
    assert [e["choices"][0]["finish_reason"] for e in relayed[:-1]] == \
           [e["choices"][0]["finish_reason"] for e in direct[:-1]]
    assert "timings" in relayed[-2]
    metrics = proxy.client.get("/metrics").text
    assert 'tandem_proxy_predicted_tokens_total{model="tiny"}' in metrics


def test_tokenizer_endpoints_route_by_the_model_in_the_body(proxy):
    """A benchmark client builds exact prompts with /tokenize, so it must reach the model's server."""
    direct = httpx.post(f"http://127.0.0.1:{proxy.replicas('tiny')[0]['port']}/tokenize",
                        json={"content": "Hello there, tides."}, timeout=30).json()
    relayed = proxy.client.post("/tokenize", json={"content": "Hello there, tides.", "model": "tiny"})
    assert relayed.status_code == 200 and relayed.json() == direct and direct["tokens"]
    back = proxy.client.post("/detokenize", json={"tokens": direct["tokens"], "model": "tiny"})
    assert back.status_code == 200 and "tides" in back.json()["content"]
    missing = proxy.client.post("/tokenize", json={"content": "Hello"})
    assert missing.status_code == 400 and "model: required" in missing.json()["error"]["message"]
    for body, problem in ((b'{"model": "tiny", "content": "\xff"}', "body is not valid UTF-8 at byte 30"),
                          (b'{"model": "tiny", "x": ' + b"[" * 100000 + b"]" * 100000 + b"}",
                           "JSON nested deeper than 128 levels")):
        refused = proxy.client.post("/tokenize", content=body)
        assert refused.status_code == 400 and refused.json()["error"]["message"].startswith(problem), refused.text


def test_unknown_and_unloaded_models_are_refused_in_openai_shape(proxy):
    r = proxy.client.post("/v1/chat/completions", json={**CHAT, "model": "nope"})
    assert r.status_code == 404 and "never, spare, tiny" in r.json()["error"]["message"]
    r = proxy.client.post("/v1/chat/completions", json={**CHAT, "model": "never"})
    error = r.json()["error"]
    assert r.status_code == 503 and "'never'" in error["message"] and "POST /jobs" in error["message"]
    metrics = proxy.client.get("/metrics").text
    assert 'requests_total{model="(unknown)",status="404"}' in metrics
    assert 'requests_total{model="never",status="503"}' in metrics


def test_six_concurrent_requests_never_exceed_two_in_flight_at_the_server(proxy):
    port = proxy.replicas("tiny")[0]["port"]
    seen, stop = [], threading.Event()

    def watch_slots():
        with httpx.Client(timeout=5) as c:
            while not stop.is_set():
                seen.append(sum(s["is_processing"] for s in c.get(f"http://127.0.0.1:{port}/slots").json()))
                time.sleep(0.02)

    def one(i: int) -> int:
        # Long enough that the watcher, polling every 20 ms, sees the slots busy (24 tokens took
        # the tiny model under 20 ms once decode ran in one kernel call).
        body = {"model": "tiny", "prompt": f"request {i}", "max_tokens": LONG_STREAM // 4, "ignore_eos": True}
        return httpx.post(proxy.url + "/v1/completions", json=body, timeout=120).status_code

    watcher = threading.Thread(target=watch_slots)
    watcher.start()
    try:
        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            codes = list(pool.map(one, range(6)))
    finally:
        stop.set()
        watcher.join()
    assert codes == [200] * 6
    assert max(seen) == 2, seen  # both slots were used, never more


def test_client_disconnect_frees_the_upstream_slot(proxy):
    port = proxy.replicas("tiny")[0]["port"]

    def processing() -> int:
        return sum(s["is_processing"] for s in httpx.get(f"http://127.0.0.1:{port}/slots").json())

    body = {"model": "tiny", "prompt": "go on", "max_tokens": LONG_STREAM, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        wait_until(lambda: next(lines).startswith("data: "), 30, "the first event")
        assert processing() == 1
    # the client has gone: the proxy closes its upstream request and the server frees the slot
    wait_until(lambda: processing() == 0, 15, "the slot to free")
    wait_until(lambda: proxy.replicas("tiny")[0]["slots_busy"] == 0, 5, "the proxy's slot count")


def test_a_queued_request_leaves_the_queue_when_its_client_disconnects(proxy):
    body = {"model": "tiny", "prompt": "busy", "max_tokens": LONG_STREAM, "ignore_eos": True, "stream": True}

    def depth() -> int:
        return next(m for m in proxy.client.get("/running").json()["models"] if m["model"] == "tiny")["queue_depth"]

    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=60), \
            httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=60):
        wait_until(lambda: proxy.replicas("tiny")[0]["slots_busy"] == 2, 10, "both slots busy")
        data = json.dumps(body).encode()
        with socket.create_connection(("127.0.0.1", proxy.port)) as waiting:
            waiting.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                            b"content-length: %d\r\n\r\n%s" % (len(data), data))
            wait_until(lambda: depth() == 1, 5, "the third request to queue")
        wait_until(lambda: depth() == 0, 5, "the queue to empty once its client left")
        assert proxy.replicas("tiny")[0]["slots_busy"] == 2
    wait_until(lambda: proxy.replicas("tiny")[0]["slots_busy"] == 0, 15, "the slots to free")


AGENT_BODIES = {  # each generating endpoint, greedy, its answer held by a grammar the random model can finish
    "/completion": {"prompt": "Say yes or no:", "n_predict": 8, "grammar": 'root ::= "yes" | "no"'},
    "/v1/responses": {"input": "Yes or no?", "max_output_tokens": 8,
                      "text": {"format": {"type": "json_schema", "name": "v", "schema": {"enum": ["yes", "no"]}}}},
    "/v1/messages": {"max_tokens": 400, "messages": [{"role": "user", "content": "Pick."}],
                     "tools": [{"name": "pick", "input_schema": {"type": "object", "properties": {
                         "colour": {"enum": ["red", "blue"]}}, "required": ["colour"]}}],
                     "tool_choice": {"type": "any", "disable_parallel_tool_use": True}},
    "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "Pick."}]},
}


@pytest.mark.parametrize("path", AGENT_BODIES)
def test_llama_servers_and_agents_endpoints_route_by_the_model_in_the_body(proxy, path):
    body = {**AGENT_BODIES[path], **({} if path.endswith("count_tokens") else {"temperature": 0})}
    direct = httpx.post(f"http://127.0.0.1:{proxy.replicas('tiny')[0]['port']}{path}", json=body, timeout=60)
    relayed = proxy.client.post(path, json={**body, "model": "tiny"})
    assert direct.status_code == relayed.status_code == 200, relayed.text
    volatile = {"id", "created_at", "timings", "usage", "model", "output", "tokens_cached"}  # the second reuses the prefix
    if path == "/v1/responses":
        assert relayed.json()["output"][0]["content"][0]["text"] == direct.json()["output"][0]["content"][0]["text"]
    elif path == "/v1/messages":
        [use] = relayed.json()["content"]
        assert use["type"] == "tool_use" and use["input"] == direct.json()["content"][0]["input"]
        assert relayed.json()["stop_reason"] == "tool_use"
    else:
        assert {k: v for k, v in relayed.json().items() if k not in volatile} == \
            {k: v for k, v in direct.json().items() if k not in volatile}


def test_openai_package_streams_through_the_proxy(proxy):
    import openai
    client = openai.OpenAI(base_url=proxy.url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model="tiny", messages=CHAT["messages"], temperature=0,
                                            max_tokens=8, stream=True)
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason in ("length", "stop")
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == text_of(chat_stream(
        proxy.url, {**CHAT, "max_tokens": 8}))


def test_logs_stream_carries_the_servers_lines(proxy):
    with httpx.stream("GET", proxy.url + "/logs/stream", params={"model": "tiny"}, timeout=10) as r:
        first = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])
    assert first["model"] == "tiny"


def test_unload_during_a_long_stream_lets_it_finish_then_the_server_is_gone(proxy):
    proxy.job("load", "spare")
    [replica] = proxy.replicas("spare")
    probe = proxy.client.post("/v1/completions", json={"model": "spare", "prompt": "x", "max_tokens": 8})
    tokens = max(40, min(900, int(3 * probe.json()["timings"]["predicted_per_second"])))  # about 3 s of stream
    body = {"model": "spare", "prompt": "long", "max_tokens": tokens, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", proxy.url + "/v1/completions", json=body, timeout=120) as r:
        lines = r.iter_lines()
        events = [json.loads(wait_until(lambda: next(lines), 30, "the first event")[6:])]
        unload = proxy.client.post("/jobs", json={"type": "unload", "model": "spare"}).json()
        [draining] = proxy.replicas("spare")
        assert draining["state"] == "draining" and draining["slots_busy"] == 1
        refused = proxy.client.post("/v1/completions", json={**body, "stream": False})
        assert refused.status_code == 503 and "being unloaded" in refused.text
        events += sse_events(lines)
        stream_ended = time.time()
    assert events[-1] == "[DONE]" and events[-2]["timings"]["predicted_n"] == tokens
    done = proxy.wait_job(unload["id"], 30)
    assert done["status"] == "succeeded" and done["finished_at"] >= stream_ended - 0.5
    assert not alive(replica["pid"]) and proxy.replicas("spare") == []


@pytest.mark.alone  # a busy neighbour would take a thread from a share
def test_replicas_run_on_cpus_of_their_own_each_with_a_thread_per_cpu(proxy):
    # The proxy's CPUs split among the replicas in the order they started (proxy/cores.py): with
    # tiny already running, the twins take the next shares; each server steps with a thread per CPU
    # of its share, and when the twins go, tiny has every CPU again.
    cpus = sorted(os.sched_getaffinity(0))
    assert proxy.job("load", "twins")["status"] == "succeeded"
    try:
        pids = [proxy.replicas("tiny")[0]["pid"], *(r["pid"] for r in proxy.replicas("twins"))]
        assert [os.sched_getaffinity(pid) for pid in pids] == [set(c) for c in split(cpus, 3)]
        for r in proxy.replicas("twins"):
            share = os.sched_getaffinity(r["pid"])
            props = lambda: httpx.get(f"http://127.0.0.1:{r['port']}/props", timeout=10).json()  # noqa: E731
            wait_until(lambda: props()["threads"] == len(share), 20, f"a thread per CPU of {share}")
    finally:
        assert proxy.job("unload", "twins")["status"] == "succeeded"
    wait_until(lambda: os.sched_getaffinity(pids[0]) == set(cpus), 10, "tiny to have every CPU again")
