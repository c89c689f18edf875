"""--kv-unified through HTTP: when the shared pool runs out mid-generation, the youngest request
stops with finish_reason "length" and its timings, and the server keeps serving."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

BODY = {"prompt": "hello there", "max_tokens": 200, "temperature": 0, "ignore_eos": True}


def test_exhausted_pool_stops_the_youngest_with_length(start_server, tiny_model):
    server = start_server(["-m", str(tiny_model), "-np", "2", "-c", "256", "--kv-unified", "-ctk", "q8_0"])
    try:
        with server.client() as c, ThreadPoolExecutor(2) as pool:
            results = [r.json() for r in pool.map(lambda body: c.post("/v1/completions", json=body), [BODY, BODY])]
            again = c.post("/v1/completions", json={**BODY, "max_tokens": 20})
        lengths = sorted(r["usage"]["completion_tokens"] for r in results)
        assert lengths[0] < 200 == lengths[1]  # 2 x (11 + 200) positions do not fit in 256
        for r in results:
            assert r["choices"][0]["finish_reason"] == "length"
            assert r["timings"]["predicted_n"] == r["usage"]["completion_tokens"]
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 20
    finally:
        server.kill()
