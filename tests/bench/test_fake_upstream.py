"""The command line against a fake upstream whose counts the test chooses: misreported requests
become invalid records with their reason, never dropped; fixture problems exit 2 before any
measured request."""
from __future__ import annotations

import json

import pytest

from bench.__main__ import main
from bench.processes import free_port
from bench.records import read_jsonl
from tests.bench.fake_upstream import MODEL, Mode


def bench(fake, tmp_path, capsys, *extra: str) -> tuple[int, dict | None, list, str]:
    """(exit code, JSON summary, records written, stderr) of a 2-lane, 2-run session."""
    out = tmp_path / "records.jsonl"
    rc = main(["--url", fake.url, "--model", MODEL, "--prompt-tokens", "32", "--gen-tokens", "8",
               "--lanes", "2", "--runs", "2", "--out", str(out), "--json", *extra])
    captured = capsys.readouterr()
    summary = json.loads(captured.out) if captured.out else None
    return rc, summary, read_jsonl(out) if out.exists() else [], captured.err


def test_honest_upstream_gives_valid_records(fake, tmp_path, capsys):
    rc, summary, records, _ = bench(fake, tmp_path, capsys)
    assert rc == 0 and len(records) == 4 and all(r.valid for r in records)
    assert summary["valid"] == 4 and summary["invalid"] == {}
    assert fake.completions == 5  # a warm-up, then 2 rounds of 2


def test_short_generation_is_kept_as_invalid_with_its_reason(fake, tmp_path, capsys):
    fake.mode = Mode(short_by=3)
    rc, summary, records, _ = bench(fake, tmp_path, capsys)
    reason = "predicted_n=5 != gen_tokens=8 (finish_reason=stop)"
    assert rc == 0 and [r.invalid_reason for r in records] == [reason] * 4
    assert summary["invalid"] == {reason: 4} and summary["valid"] == 0
    assert summary["aggregate_tg"] is None  # no clean round


def test_reported_cache_reuse_is_kept_as_invalid_with_its_reason(fake, tmp_path, capsys):
    fake.mode = Mode(cache_n=7)
    _, summary, records, _ = bench(fake, tmp_path, capsys)
    reason = "cache_n=7: prompt tokens reused from the cache; prompt_n=25 != prompt_tokens=32"
    assert [r.invalid_reason for r in records] == [reason] * 4 and summary["invalid"] == {reason: 4}


def test_without_timings_records_use_usage_and_client_times_and_say_reuse_is_unknown(fake, tmp_path, capsys):
    fake.mode = Mode(timings=False)
    _, summary, records, _ = bench(fake, tmp_path, capsys)
    assert all(r.valid and r.cache_n is None and r.timings_source == "client" for r in records)
    assert all(r.prompt_n == 32 and r.predicted_n == 8 and r.predicted_per_second > 0 for r in records)
    assert summary["cache_unknown"] == 4


def test_failed_requests_are_records_not_gaps(fake, tmp_path, capsys):
    fake.mode = Mode(fail_from=2)  # the warm-up and the first measured request succeed
    rc, summary, records, _ = bench(fake, tmp_path, capsys)
    assert rc == 0 and len(records) == 4
    assert sorted(r.invalid_reason or "" for r in records) == ["", *["HTTP 500: the fake engine failed"] * 3]
    assert summary["records"] == 4 and summary["valid"] == 1


@pytest.mark.parametrize("mode, args, message, sent", [
    (Mode(), ["--model", "other"], "model 'other': http://127.0.0.1:", 0),
    (Mode(tokens_per_word=0.5), [], "cannot build a 32-token prompt", 0),
    (Mode(extra_prompt_tokens=1), [], "the server counted 33 prompt tokens for 32 token ids", 1),
])
def test_fixture_problems_exit_2_before_any_measured_request(fake, tmp_path, capsys, mode, args, message, sent):
    fake.mode = mode
    rc, summary, records, err = bench(fake, tmp_path, capsys, *args)
    assert rc == 2 and summary is None and records == []  # the records file is opened first, and stays empty
    assert message in " ".join(err.split())  # rich wraps long lines
    assert fake.completions == sent  # at most the warm-up


def test_unreachable_server_exits_2(tmp_path, capsys):
    rc = main(["--url", f"http://127.0.0.1:{free_port()}", "--model", MODEL, "--out", str(tmp_path / "r.jsonl")])
    assert rc == 2 and "server unreachable" in capsys.readouterr().err
    assert (tmp_path / "r.jsonl").read_text() == ""


def test_unwritable_records_file_exits_2_before_any_request(fake, tmp_path, capsys):
    rc = main(["--url", fake.url, "--model", MODEL, "--out", str(tmp_path / "missing" / "r.jsonl")])
    assert rc == 2 and "--out" in capsys.readouterr().err and fake.completions == 0
