"""The validity rule of a benchmark record (docs/architecture.md, "Benchmark records")."""
from __future__ import annotations

import json

from bench.records import INTERRUPTED, Record, read_jsonl


def served(**changes) -> Record:
    """A record of a fresh 64-token prompt and 16 generated tokens, as the server reported it."""
    fields = dict(lane=0, run=0, prompt_tokens=64, gen_tokens=16, start_s=0.0, end_s=1.0, cache_n=0, prompt_n=64,
                  predicted_n=16, usage_prompt_tokens=64, usage_completion_tokens=16, timings_source="server",
                  finish_reason="length", predicted_per_second=20.0, ttft_ms=5.0, itl_ms=[1.0, 2.0])
    return Record(**{**fields, **changes})


def test_fresh_exact_and_consistent_record_is_valid():
    r = served()
    assert r.valid and r.invalid_reason is None and r.cache_known


def test_reused_prefix_is_invalid_with_its_size():
    r = served(cache_n=10, prompt_n=54)
    assert not r.valid
    assert r.invalid_reason == "cache_n=10: prompt tokens reused from the cache; prompt_n=54 != prompt_tokens=64"


def test_short_generation_is_invalid_and_names_the_finish_reason():
    r = served(predicted_n=9, usage_completion_tokens=9, finish_reason="stop")
    assert r.invalid_reason == "predicted_n=9 != gen_tokens=16 (finish_reason=stop)"


def test_timings_disagreeing_with_usage_is_invalid():
    assert served(usage_prompt_tokens=65).invalid_reason == "usage.prompt_tokens=65 != cache_n + prompt_n"
    assert served(usage_completion_tokens=17).invalid_reason == "usage.completion_tokens=17 != predicted_n"


def test_failed_request_keeps_its_error_as_the_reason():
    assert Record(lane=1, run=2, prompt_tokens=64, gen_tokens=16, start_s=0.0,
                  error=INTERRUPTED).invalid_reason == INTERRUPTED
    assert served(usage_prompt_tokens=None).invalid_reason == "no usage in the final chunk"


def test_without_timings_cache_reuse_is_unknown_not_assumed():
    r = served(cache_n=None, timings_source="client")
    assert r.valid and not r.cache_known
    assert r.to_dict()["cache_known"] is False


def test_jsonl_round_trip_recomputes_validity(tmp_path):
    path = tmp_path / "r.jsonl"
    records = [served(), served(lane=1, cache_n=3, prompt_n=61)]
    path.write_text("".join(r.to_json() + "\n" for r in records))
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [d["valid"] for d in lines] == [True, False]
    assert set(lines[0]) >= {"lane", "run", "prompt_tokens", "gen_tokens", "cache_n", "prompt_n", "predicted_n",
                             "prompt_per_second", "predicted_per_second", "draft_n", "draft_n_accepted",
                             "ttft_ms", "e2e_ms", "itl_ms", "valid", "invalid_reason"}
    assert read_jsonl(path) == records
