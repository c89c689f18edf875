"""Speculation through HTTP: same greedy text as without it, whatever the drafter or the request's
own limits (llama-server's `speculative.n_max`, `n_min`, `p_min`), and its counters in timings,
/slots, /metrics and /props."""
from __future__ import annotations

import re

import pytest

from engine.settings import DEFAULT_DRAFT
from tests.server.test_devices_flags import start

PROMPT = "the cat sat on the mat and the cat sat on the mat and the cat sat on the"


@pytest.fixture(scope="module")
def servers(start_server, tiny_model):
    common = ["-m", str(tiny_model), "-c", "1024", "-np", "1", "--alias", "tiny"]
    plain = start_server(common)
    # Without pacing: these tests count drafts under the request's limits, and pacing, from step times
    # measured beside the other test worker, may pause a request's drafting for all its 48 tokens.
    spec = start_server(common + ["--spec-type", "ngram", "--spec-draft-n-max", "3", "--spec-draft-p-min", "0",
                                  "--spec-ngram-size-n", "2", "--no-spec-pacing"])
    return plain, spec


@pytest.fixture(scope="module")
def combined(start_server, tiny_model, tmp_path_factory):
    """A server with draft-mtp-ngram (by its alias) and an untrained MTP draft for the tiny model,
    verifying siblings beside its chains."""
    from engine.files.weights import open_model
    from engine.model import mtp
    from tests.engine.test_mtp import save_draft
    files = open_model(tiny_model)
    tensors = files.load_tensors()
    draft = tmp_path_factory.mktemp("draft") / "draft.safetensors"
    save_draft(draft, files.config, tensors, mtp.target_fingerprint(files.config, tensors["model.embed_tokens.weight"]))
    # Siblings too (three candidates per depth, however unlikely): every verify row is a tree.
    return start_server(["-m", str(tiny_model), "-c", "1024", "-np", "1", "--alias", "tiny", "--spec-type", "mtp-ngram",
                         "-md", str(draft), "--spec-ngram-size-n", "2", "--spec-draft-width", "3",
                         "--spec-draft-p-sibling", "0"])


def post(server, **extra):
    with server.client() as c:
        return c.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 48,
                                               "temperature": 0, "ignore_eos": True, **extra})


def complete(server, **extra) -> dict:
    r = post(server, **extra)
    assert r.status_code == 200, r.text
    return r.json()


def test_ngram_speculation_keeps_greedy_text_and_reports_drafts(servers):
    plain, spec = servers
    expected, got = complete(plain), complete(spec)
    assert got["choices"][0]["text"] == expected["choices"][0]["text"]
    timings = got["timings"]
    assert timings["draft_n"] > 0 and 0 <= timings["draft_n_accepted"] <= timings["draft_n"]
    assert "draft_n" not in expected["timings"]


def test_speculation_counters_in_props_slots_and_metrics(servers):
    _, spec = servers
    done = complete(spec)["timings"]
    with spec.client() as c:
        props = c.get("/props").json()["speculative"]
        slots = c.get("/slots").json()
        metrics = c.get("/metrics").text
    assert props["type"] == "ngram-simple" and props["n_max"] == 3 and props["p_min"] == 0
    assert slots[0]["speculative"] is True and {"draft_n", "draft_n_accepted"} <= slots[0].keys()
    drafted = int(float(re.search(r"^tandem:draft_tokens_total (\S+)$", metrics, re.M).group(1)))
    assert drafted >= done["draft_n"] > 0
    ratios = re.findall(r'^tandem:draft_position_acceptance_ratio\{position="(\d)"\} (\S+)$', metrics, re.M)
    assert [p for p, _ in ratios][:1] == ["0"] and all(0 <= float(v) <= 1 for _, v in ratios)


def test_bad_speculation_flags_are_refused_before_loading(tiny_model):
    from engine.errors import ConfigError
    from engine.preflight import read_headers
    from server.cli import parse
    # Without -md an MTP draft is the model's own MTP layers, which this model has none of.
    with pytest.raises(ConfigError, match=r"spec_draft_model=None: is required with spec_type=draft-mtp unless the "
                                          r"model carries its own MTP layers, and .* has none"):
        read_headers(parse(["-m", str(tiny_model), "--spec-type", "mtp"])[0])
    with pytest.raises(ConfigError, match=r"spec_draft_n_min=5: must be in 0..spec_draft_n_max=3"):
        parse(["--spec-type", "ngram", "--spec-draft-n-min", "5"])


def test_request_limits_keep_greedy_text_and_bound_the_drafts(servers):
    plain, spec = servers
    expected = complete(plain)["choices"][0]["text"]
    none = complete(spec, **{"speculative.n_max": 0})
    assert none["choices"][0]["text"] == expected
    assert none["timings"].get("draft_n", 0) == 0, "n_max 0 drafts nothing (timings leave out zero counts)"
    one = complete(spec, **{"speculative.n_max": 1, "speculative.n_min": 1, "speculative.p_min": 0.9})
    assert one["choices"][0]["text"] == expected
    # At most one draft a step, and a step emits at least one token.
    assert 0 < one["timings"]["draft_n"] <= one["timings"]["predicted_n"]


def test_the_limits_as_one_speculative_object_are_the_flat_keys(servers):
    plain, spec = servers
    one = complete(spec, speculative={"n_max": 1, "n_min": 1, "p_min": 0.9})
    assert one["choices"][0]["text"] == complete(plain)["choices"][0]["text"]
    assert 0 < one["timings"]["draft_n"] <= one["timings"]["predicted_n"]


@pytest.mark.parametrize("extra, message", [
    ({"speculative.n_max": 4},
     "speculative.n_max=4: must be <= the server's --spec-draft-n-max=3 (its verify rows are sized for it)"),
    ({"speculative.n_min": 4}, "speculative.n_min=4: must be in 0..speculative.n_max=3"),
    ({"speculative.p_min": 2}, "speculative.p_min: must be in [0, 1], got 2.0"),
    ({"speculative": {"n_max": 1000000000}},
     "speculative.n_max=1000000000: must be <= the server's --spec-draft-n-max=3 (its verify rows are sized for it)"),
    ({"speculative": {"n_max": "x"}}, "speculative.n_max: Input should be a valid integer, unable to parse string as an integer"),
    ({"speculative": {"n_max": -3}}, "speculative.n_max: must be >= 0 (0 drafts nothing), got -3"),
    ({"speculative": {"p_min": 5}}, "speculative.p_min: must be in [0, 1], got 5.0"),
    ({"speculative": {"n_maxx": 2}}, "speculative: unknown key(s) n_maxx (it holds n_max, n_min, p_min)"),
    ({"speculative": {"n_max": 2}, "speculative.n_max": 2},
     "speculative.n_max: given both flat and inside the speculative object; give one"),
])
def test_bad_request_limits_are_refused_naming_field_value_and_rule(servers, extra, message):
    _, spec = servers
    r = post(spec, **extra)
    assert r.status_code == 400 and r.json()["error"]["message"] == message


def test_a_server_that_does_not_speculate_ignores_request_limits(servers):
    # As llama-server does: a client can send the same body to every server.
    plain, _ = servers
    got = complete(plain, **{"speculative.n_max": 99, "speculative.p_min": 0})
    assert got["choices"][0]["text"] == complete(plain)["choices"][0]["text"] and "draft_n" not in got["timings"]
    assert post(plain, **{"speculative.n_max": -1}).status_code == 400, "the ranges are checked at the edge"


def test_combined_drafter_with_siblings_keeps_greedy_text_and_reports_its_settings(servers, combined):
    plain, _ = servers
    got = complete(combined)
    assert got["choices"][0]["text"] == complete(plain)["choices"][0]["text"]
    assert got["timings"]["draft_n"] > 0
    with combined.client() as c:
        spec = c.get("/props").json()["speculative"]
        metrics = c.get("/metrics").text
    assert (spec["type"], spec["width"], spec["p_sibling"], spec["pacing"]) == ("draft-mtp-ngram", 3, 0.0, True)
    assert re.search(r"^tandem:draft_siblings_kept_total \d+$", metrics, re.M)


def test_the_shipped_draft_with_another_target_exits_2_naming_the_fingerprint_rule(tiny_model):
    done = start(["-m", str(tiny_model), "--spec-type", "draft-mtp", "-md", "default"])
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: spec_draft_model={str(DEFAULT_DRAFT)!r}: trained for another target")
    assert "a draft serves only the target whose fingerprint it carries" in last
    assert "listening" not in done.stderr
