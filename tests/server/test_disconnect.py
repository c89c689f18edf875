"""A client that drops its connection mid-stream costs the server that one request, nothing more."""
from __future__ import annotations

import json
import signal
import socket
import time

import httpx

BODY = {"messages": [{"role": "user", "content": "hi"}], "temperature": 0, "max_tokens": 3000, "ignore_eos": True,
        "stream": True}


def leave_mid_stream(port: int) -> None:
    """Starts a stream, reads up to its first event, and closes the connection: the server's next
    write is answered with a reset, and the one after fails with EPIPE."""
    data = json.dumps(BODY).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"content-length: %d\r\n\r\n%s" % (len(data), data))
        received = b""
        while b"data: " not in received:
            chunk = s.recv(4096)
            assert chunk, "the server closed the stream before its first event"
            received += chunk


def test_clients_leaving_mid_stream_leave_the_server_serving(start_server, tiny_model):
    server = start_server(["-m", str(tiny_model), "-c", "8192", "-np", "2"])
    for _ in range(5):
        leave_mid_stream(server.port)
        time.sleep(0.2)  # the server writes the next chunks into the closed connection
        assert server.proc.poll() is None, f"the server died (exit {server.proc.returncode}):\n{server.log_text()}"
    r = httpx.post(f"{server.url}/v1/chat/completions", json={**BODY, "stream": False, "max_tokens": 8}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 8
    slots = httpx.get(f"{server.url}/slots", timeout=10).json()
    assert not any(s["is_processing"] for s in slots)  # the abandoned streams were cancelled, not left running


def test_the_server_ignores_sigpipe(start_server, tiny_model):
    # With SIGPIPE's default action a write into a connection the peer has reset kills the whole
    # process (a replica behind the proxy died this way, exit code -13); ignored, the write fails
    # with EPIPE and only that request ends.
    server = start_server(["-m", str(tiny_model), "-c", "2048"])
    with open(f"/proc/{server.proc.pid}/status") as f:
        ignored = int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)
    assert ignored & (1 << (signal.SIGPIPE - 1))
