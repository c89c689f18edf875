"""Benchmark clients: a library plus thin entry points (`python -m bench`).

workload (what is asked, prompts built to an exact token count), client (the server's endpoints,
one streamed request timed into a Record), records (the record and its validity rule), session
(preflight, warm-up, concurrent rounds, Ctrl-C), summary (figures, table, JSON), plot (PNG).
"""
