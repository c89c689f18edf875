"""The seed's shape as shipped (configs/profiles/smollm2.yaml, `smollm2-seed`: QSA every4:4 beside
the dense MTP draft, 2 slots, 2 pipeline stages, the draft on a rank of its own; and
configs/profiles/qwen4_exp.yaml, the same on a tiny Qwen4-Exp with its own MTP layer), loaded through
a proxy job, streams a chat past its QSA budget with the greedy tokens of the same file and format
in one process without speculation."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
import yaml

from bench.processes import ROOT
from engine.cli.tiny import tiny_config, write_tiny_model
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
QWEN4_PROMPTS = ["Tell me about the tide that comes in twice a day.", "Describe a lantern in the harbour master's window."]


@pytest.mark.alone  # the draft's pacing weighs its measured cost: a busy neighbour can stop it drafting
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


def test_the_seed_profile_on_a_tiny_qwen4_exp_drafts_with_its_own_mtp_layer_past_the_indexers_budget(
        make_proxy, tmp_path):
    """configs/profiles/qwen4_exp.yaml, `qwen4-exp-seed` (QSA on every fourth layer by the model's
    indexer, its dense MTP layer drafting 1 to 3 tokens on a rank of its own, 2 slots sharing a q8_0
    cache, -pp 2) on the checkpoint its comment makes: two chats at once, one streamed, give the
    greedy tokens of the same checkpoint and cache format in one process without speculation."""
    model = write_tiny_model(tiny_config("qwen4_exp_seed"), tmp_path / "tiny-qwen4-exp-seed", seed=0)
    profile = yaml.safe_load((ROOT / "configs" / "profiles" / "qwen4_exp.yaml").read_text())["qwen4-exp-seed"]
    shipped = profile["args"][profile["args"].index("-m") + 1]
    assert shipped.endswith("/tiny-qwen4-exp-seed")
    proxy = make_proxy({"qwen4-exp-seed": {**profile, "args": [str(model) if a == shipped else a
                                                               for a in profile["args"]]}})
    assert proxy.job("load", "qwen4-exp-seed", timeout=300)["status"] == "succeeded"
    # A random MTP layer is seldom right: p_min 0 lets every step draft, so rejections roll back.
    bodies = [{"model": "qwen4-exp-seed", "messages": [{"role": "user", "content": p}], "max_tokens": TOKENS,
               "temperature": 0, "ignore_eos": True, "logprobs": True, "speculative.p_min": 0, "stream": stream}
              for p, stream in zip(QWEN4_PROMPTS, (False, True))]

    def ask(body):
        if not body["stream"]:
            return proxy.client.post("/v1/chat/completions", json=body, timeout=180).json()
        with proxy.client.stream("POST", "/v1/chat/completions", json=body, timeout=180) as r:
            assert r.status_code == 200
            events = sse_events(r.iter_lines())
        assert events[-1] == "[DONE]"
        chunks = [e for e in events if isinstance(e, dict)]
        return {"logprobs": [entry for c in chunks if c["choices"] and c["choices"][0].get("logprobs")
                             for entry in c["choices"][0]["logprobs"]["content"]], "timings": chunks[-1]["timings"]}
    with ThreadPoolExecutor(2) as pool:
        plain_answer, streamed = pool.map(ask, bodies)
    assert proxy.job("unload", "qwen4-exp-seed")["status"] == "succeeded"

    engine = Engine.load(EngineConfig(model=str(model), dtype="auto", ctx_size=1024, parallel=1, cache_type="q8_0"))
    logits = next_token_logits(engine.model)
    for prompt, got, timings in ((QWEN4_PROMPTS[0], plain_answer["choices"][0]["logprobs"]["content"],
                                  plain_answer["timings"]), (QWEN4_PROMPTS[1], streamed["logprobs"], streamed["timings"])):
        ids = chat_ids(engine, prompt)
        assert timings["prompt_n"] > engine.model.config.qsa_budget and timings["draft_n"] > 0
        expected = run_all(engine, [ids], SamplingParams(temperature=0, max_tokens=TOKENS,
                                                         ignore_eos=True))[0].output_ids
        assert_same_greedy([entry["id"] for entry in got], expected, ids, logits)
