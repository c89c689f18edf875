"""The seed's shape as shipped (configs/profiles/smollm2.yaml, `smollm2-seed`: QSA every4:4 beside
the dense MTP draft, 2 slots, 2 pipeline stages, the draft on a rank of its own), loaded through a
proxy job, streams a chat past its QSA budget with the greedy tokens of the same file and format
in one process without speculation."""
from __future__ import annotations

import yaml

from bench.processes import ROOT
from engine.engine import Engine
from engine.sched.sampling import SamplingParams
from engine.settings import CompressRatios, EngineConfig
from tests.engine.runs import run_all
from tests.engine.test_generation import chat_ids
from tests.exact_tokens import assert_same_greedy, next_token_logits
from tests.proxy.conftest import sse_events

TOKENS = 24
# Forty numbered sentences: about 900 tokens, well past the profile's budget of 512 positions.
DOCUMENT = " ".join(f"Entry {i}: the keeper of light {i % 7} logged {3 * i} ships and {i % 5} storms that night."
                    for i in range(40))
QUESTION = "\n\nWhich entry logged the most ships?"


def test_the_seed_profile_loads_by_job_and_streams_a_chat_past_its_qsa_budget(make_proxy):
    profile = yaml.safe_load((ROOT / "configs" / "profiles" / "smollm2.yaml").read_text())["smollm2-seed"]
    proxy = make_proxy({"smollm2-seed": profile}, groups={"smollm2": {"exclusive": True}})
    job = proxy.job("load", "smollm2-seed", timeout=300)
    assert job["status"] == "succeeded", job
    body = {"model": "smollm2-seed", "messages": [{"role": "user", "content": DOCUMENT + QUESTION}],
            "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": True, "logprobs": True}
    with proxy.client.stream("POST", "/v1/chat/completions", json=body, timeout=180) as r:
        assert r.status_code == 200
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [e for e in events if isinstance(e, dict)]
    got = [entry["id"] for c in chunks if c["choices"] and c["choices"][0].get("logprobs")
           for entry in c["choices"][0]["logprobs"]["content"]]
    timings = chunks[-1]["timings"]
    assert timings["prompt_n"] > 512 and timings["draft_n"] > 0
    assert proxy.job("unload", "smollm2-seed")["status"] == "succeeded"

    engine = Engine.load(EngineConfig(model="default", dtype="auto", ctx_size=2048, parallel=1,
                                      compress_ratios=CompressRatios.parse("every4:4"), qsa_budget=512))
    ids = chat_ids(engine, DOCUMENT + QUESTION)
    expected = run_all(engine, [ids], SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))[0].output_ids
    assert len(got) == TOKENS
    assert_same_greedy(got, expected, ids, next_token_logits(engine.model))
