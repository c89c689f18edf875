"""A stand-in for `python -m server` in proxy tests, started by the proxy like a real server (same
flags) and quick to start: a tiny-model server takes seconds to load, more on a busy machine.

FAKE_SERVER (environment) picks the behaviour:
    serve     /health 200, /props as the profile expects (one slot), and any POST answered as a
              completion of 2 tokens after `sleep` seconds (a field of the request body); one
              with `"stream": true` as a chat stream of FAKE_REPLY's text (environment), a word
              per chunk, ending with `timings` whose prompt_n is the number of messages sent
    slow      says it is loading, starts a helper process (as a real server may), never listens
    killed    prints a line and kills itself with SIGKILL
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def serve(args: list[str]) -> None:
    alias, model, port = flag(args, "--alias"), flag(args, "-m"), int(flag(args, "--port"))

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as the proxy's upstream client expects

        def reply(self, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self.reply({"status": "ok"} if self.path == "/health" else
                       {"model_alias": alias, "model_path": model, "total_slots": 1})

        def stream(self, messages: list) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Connection", "close")
            self.end_headers()
            words = os.environ.get("FAKE_REPLY", "ok").split(" ")
            chunks = [{"choices": [{"index": 0, "delta": {"content": w if i == 0 else " " + w}}]}
                      for i, w in enumerate(words)]
            chunks.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
                           "timings": {"prompt_n": len(messages), "prompt_per_second": 300.0, "predicted_n": len(words),
                                       "predicted_per_second": 30.0}})
            for chunk in chunks:
                self.wfile.write(b"data: " + json.dumps({"model": alias, **chunk}).encode() + b"\n\n")
            self.wfile.write(b"data: [DONE]\n\n")
            self.close_connection = True

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if body.get("stream"):
                return self.stream(body.get("messages", []))
            time.sleep(float(body.get("sleep", 0)))
            self.reply({"object": "text_completion", "model": alias, "usage": {"completion_tokens": 2},
                        "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}]})

        def log_message(self, *args) -> None:
            pass

    ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()


def main() -> None:
    mode = os.environ.get("FAKE_SERVER", "serve")
    print(f"INFO fake server ({mode}) loading", flush=True)
    if mode == "slow":
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        time.sleep(120)
    elif mode == "killed":
        os.kill(os.getpid(), signal.SIGKILL)
    else:
        serve(sys.argv[1:])


if __name__ == "__main__":
    main()
