"""--kv-unified through HTTP: when the shared pool runs out mid-generation, the youngest request is
paused and resumed; every request gets all the tokens it asked for, the same text it gets alone, and
timings that say how many positions were computed again."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

BODY = {"prompt": "hello there", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "cache_prompt": False}


def test_exhausted_pool_pauses_the_youngest_and_every_request_gets_all_its_tokens(start_server, tiny_model):
    server = start_server(["-m", str(tiny_model), "-np", "2", "-c", "256", "--kv-unified", "-ctk", "q8_0"])
    try:
        with server.client() as c, ThreadPoolExecutor(2) as pool:
            alone = c.post("/v1/completions", json=BODY).json()
            results = [r.json() for r in pool.map(lambda body: c.post("/v1/completions", json=body), [BODY, BODY])]
            again = c.post("/v1/completions", json={**BODY, "max_tokens": 20})
            metrics = c.get("/metrics").text
        for r in results:  # 2 x (11 + 200) positions do not fit in 256
            assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 200
            assert r["choices"][0]["text"] == alone["choices"][0]["text"]
            assert r["timings"]["predicted_n"] == 200 and r["timings"]["prompt_n"] == r["usage"]["prompt_tokens"]
        recomputed = sorted(r["timings"].get("recomputed_n", 0) for r in results)
        assert recomputed[0] == 0 < recomputed[1] and "recomputed_n" not in alone["timings"]
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 20
        preempted = [line for line in metrics.splitlines() if line.startswith("tandem:preemptions_total ")]
        assert preempted and int(preempted[0].split()[1]) > 0
    finally:
        server.kill()
