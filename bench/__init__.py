"""Benchmarks. A client library plus thin entry points (`python -m bench`): workload (what is asked,
prompts built to an exact token count), client (the server's endpoints, one streamed request timed
into a Record), records (the record and its validity rule), session (preflight, warm-up, concurrent
rounds, Ctrl-C), summary (figures, table, JSON), plot (PNG).

In one process with the engine: formats (`python -m bench.formats`, PP and TG per weight format)
and compare (`python -m bench.compare`, beside transformers and llama.cpp). Around real processes:
server_tg (the engine alone against the HTTP server) and proxy_overhead (what the proxy adds).
"""
