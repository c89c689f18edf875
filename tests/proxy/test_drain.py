"""SIGTERM on the proxy drains as an unload does: new requests, and those still waiting for a slot,
get 503 with Retry-After and /health says draining; a stream running across the signal finishes, or, past the proxy's
shutdown_drain_timeout (else the profile's drain_timeout), ends with an in-band error event and
[DONE]; the servers stop, the proxy exits 0, and the job history records each model's unload as
the shutdown's."""
from __future__ import annotations

import json
import signal
import threading

import httpx
import yaml

from bench.processes import ProxyProcess, alive, wait_until
from tests.proxy.conftest import LONG_STREAM, tiny_profile

CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "Say something."}], "temperature": 0,
        "max_tokens": LONG_STREAM, "ignore_eos": True, "stream": True}


def stream_in_background(url: str) -> tuple[threading.Thread, list[str], threading.Event]:
    """A long stream's `data:` payloads as they arrive, and an event set at its first."""
    lines, started = [], threading.Event()

    def read() -> None:
        with httpx.stream("POST", url + "/v1/chat/completions", json=CHAT, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    lines.append(line[6:])
                    started.set()
    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread, lines, started


def sigterm_while_streaming(proxy, queue: list | None = None) -> tuple[list[str], list[int]]:
    """Loads the model, starts a long stream (and, given `queue`, a request that waits behind it,
    whose answer goes there), SIGTERMs the proxy; checks what a new request meets meanwhile;
    returns the stream's payloads and the servers that ran, once the proxy has exited 0."""
    assert proxy.job("load", "tiny")["status"] == "succeeded"
    servers = proxy.descendants()
    thread, lines, started = stream_in_background(proxy.url)
    assert started.wait(60), "the stream never started"
    if queue is not None:
        waiter = threading.Thread(target=lambda: queue.append(httpx.post(
            proxy.url + "/v1/chat/completions", json={**CHAT, "stream": False}, timeout=60)), daemon=True)
        waiter.start()
        wait_until(lambda: proxy.client.get("/running").json()["models"][0]["queue_depth"] == 1, 10,
                   "a request waiting for the slot")
    proxy.proc.send_signal(signal.SIGTERM)
    refused = wait_until(lambda: (lambda r: r if r.status_code == 503 else None)(
        httpx.post(proxy.url + "/v1/chat/completions", json={**CHAT, "stream": False}, timeout=10)), 10,
        "a new request refused while draining")
    assert "shutting down" in refused.json()["error"]["message"] and refused.headers["retry-after"]
    assert httpx.get(proxy.url + "/health", timeout=10).json() == {"status": "draining"}
    thread.join(60)
    if queue is not None:
        waiter.join(10)
    assert proxy.proc.wait(60) == 0, "the proxy did not exit 0 after draining"
    wait_until(lambda: not any(alive(pid) for pid in servers), 20, "the servers to be gone")
    return lines, servers


def shutdown_unloads(proxy) -> list[dict]:
    proxy.start()
    return [j for j in proxy.client.get("/jobs", params={"model": "tiny"}).json() if j["trigger"] == "shutdown"]


def test_a_stream_running_across_sigterm_finishes_and_the_proxy_exits_0(make_proxy, tiny_model):
    proxy = make_proxy({"tiny": tiny_profile(tiny_model, parallel=1, drain_timeout=60)})
    queued: list[httpx.Response] = []
    lines, _ = sigterm_while_streaming(proxy, queue=queued)
    [refused] = queued  # it waited for the one slot when the signal came: refused as a new request is
    assert refused.status_code == 503 and refused.headers["retry-after"], refused.text
    assert "shutting down" in refused.json()["error"]["message"]
    assert lines[-1] == "[DONE]"
    last = json.loads(lines[-2])
    assert last["choices"][0]["finish_reason"] == "length" and last["timings"]["predicted_n"] == LONG_STREAM
    [unload] = shutdown_unloads(proxy)
    assert unload["type"] == "unload" and unload["status"] == "succeeded"


def test_a_stream_past_the_proxys_drain_timeout_ends_with_an_error_event_and_done(tmp_path_factory, tiny_model):
    proxy = ProxyProcess(tmp_path_factory.mktemp("proxy"), {"tiny": tiny_profile(tiny_model, drain_timeout=600)})
    settings = yaml.safe_load((proxy.root / "proxy.yaml").read_text())
    (proxy.root / "proxy.yaml").write_text(yaml.safe_dump({**settings, "shutdown_drain_timeout": 0.5}))
    try:
        lines, _ = sigterm_while_streaming(proxy.start())
        error = json.loads(lines[-2])["error"]
        assert lines[-1] == "[DONE]" and error["code"] == 503 and "the 0.5 s drain timeout" in error["message"], error
        [unload] = shutdown_unloads(proxy)
        assert "1 request(s) still running after the 0.5 s drain timeout were cancelled" in unload["message"]
    finally:
        proxy.kill_all()


def test_a_second_signal_ends_the_running_requests_at_once(make_proxy, tiny_model):
    proxy = make_proxy({"tiny": tiny_profile(tiny_model, drain_timeout=600)})
    assert proxy.job("load", "tiny")["status"] == "succeeded"
    thread, lines, started = stream_in_background(proxy.url)
    assert started.wait(60)
    proxy.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: httpx.get(proxy.url + "/health", timeout=10).status_code == 503, 10, "the drain to start")
    proxy.proc.send_signal(signal.SIGTERM)
    thread.join(30)
    assert proxy.proc.wait(30) == 0
    assert lines[-1] == "[DONE]" and "a second signal" in json.loads(lines[-2])["error"]["message"]
