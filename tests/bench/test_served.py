"""bench.compare --http's measurement (bench/served.py): a real tandem server process, timed from
its stream, counted by the server's own token counts; the table's ratios."""
from __future__ import annotations

import os

import httpx
import pytest

from bench import served
from bench.compare import held_table, served_table
from engine.cli.tiny import tiny_config, write_tiny_model

TEXTS = ["The river", "A list of three colours:", "Once upon a time"]


@pytest.fixture(scope="module")
def tandem(tmp_path_factory):
    config = tiny_config()
    model = write_tiny_model(config, tmp_path_factory.mktemp("tiny-served"), seed=0)
    # A name may carry a file's path, as rows of several drafts do: the server's log still opens.
    server = served.TandemServer(f"tandem f32 ({model})", ["-m", str(model), "-np", "2", "-c", "512"], 1,
                                 tmp_path_factory.mktemp("served-logs"))
    try:
        server.start()
        yield server
    finally:
        server.stop()


def _completion_tokens(server, text: str, n: int) -> int:
    body = {**server.body(text, n, 0.0, 0), "stream": False}
    return httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["usage"]["completion_tokens"]


@pytest.mark.parametrize("lanes", [1, 2])
def test_measure_counts_the_tokens_after_each_streams_first(tandem, lanes):
    sample = served.measure(tandem, TEXTS, 12, 0.0, lanes, seed=0)
    assert sample.tokens == sum(_completion_tokens(tandem, t, 12) - 1 for t in TEXTS)
    assert sample.seconds > 0 and sample.tg > 0
    assert (sample.drafted, sample.accepted) == (0, 0)  # no drafter on this server
    assert sample.prompt_tokens > 0 and sample.prompt_seconds > 0  # the server's prompt_n, over each first wait


def test_a_constrained_twin_holds_each_answer_to_the_schema_on_the_same_server(tandem):
    schema = {"type": "object", "properties": {"yes": {"type": "boolean"}}, "required": ["yes"]}
    twin = served.Constrained(tandem, {"json_schema": schema}, "yes.json")
    assert twin.url == tandem.url and twin.name == tandem.name + " [yes.json]"
    body = {**twin.body(TEXTS[0], 200, 0.0, 0), "stream": False}  # the whitespace between tokens is bounded
    text = httpx.post(twin.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    assert "".join(text.split()) in ('{"yes":true}', '{"yes":false}')
    sample = served.measure(twin, TEXTS[:1], 200, 0.0, 1, seed=0)
    assert sample.tokens == len(text) - 1  # the tiny model's tokens are bytes


def test_held_table_gives_each_system_held_to_a_grammar_against_itself_free():
    rows = [served.Series("tandem auto + draft-mtp", [150.0], drafted=100, accepted=60),
            served.Series(served.LlamaServer.NAME, [100.0]),
            served.Series("tandem auto + draft-mtp [answer.json]", [140.0], drafted=80, accepted=60),
            served.Series(served.LlamaServer.NAME + " [any-text.gbnf]", [90.0])]
    lines = held_table(rows).splitlines()
    assert lines[1].split() == ["tandem", "auto", "+", "draft-mtp", "[answer.json]", "140.0", "0.93x", "60/80",
                                "=", "0.75", "0.60"]
    assert lines[2].split() == ["llama-server", "[any-text.gbnf]", "90.0", "0.90x"]


def test_table_gives_each_drafted_system_against_its_plain_twin_and_llama_server():
    rows = [served.Series("tandem int8", [100.0, 110.0, 90.0]),
            served.Series("tandem int8 + draft-mtp", [150.0, 160.0, 140.0], drafted=200, accepted=150),
            # several drafts in one command are told apart by their paths, against the same plain twin
            served.Series("tandem int8 + draft-mtp (a-much-longer-draft-file-name)", [120.0], drafted=10, accepted=4),
            served.Series(served.LlamaServer.NAME, [120.0, 80.0, 100.0])]
    lines = served_table(rows).splitlines()
    assert lines[0].split()[4] == "/llama-server"
    assert lines[1].split() == ["tandem", "int8", "100.0", "1.00x"]
    assert lines[2].split() == ["tandem", "int8", "+", "draft-mtp", "150.0", "1.50x", "1.50x", "150/200", "=", "0.75"]
    assert lines[3].split()[5:] == ["120.0", "1.20x", "1.20x", "4/10", "=", "0.40"]
    assert lines[4].split() == ["llama-server", "100.0", "1.00x"]
    assert lines[3].index("120.0") == lines[1].index("100.0")  # the long name widens the column for every row


def test_table_gives_pp_against_llama_server_where_measured():
    rows = [served.Series("tandem int8", [100.0], pp=[600.0, 500.0, 400.0]),
            served.Series(served.LlamaServer.NAME, [80.0], pp=[250.0])]
    lines = served_table(rows).splitlines()
    assert lines[0].split()[-3:] == ["PP", "tok/s", "/llama-server"]
    assert lines[1].split() == ["tandem", "int8", "100.0", "1.25x", "500.0", "2.00x"]


def test_document_prompts_are_long_and_share_no_prefix():
    from bench.compare import with_document
    from engine import Tokenizer
    from engine.files.weights import open_model
    tokenizer = Tokenizer.load(open_model("default"))
    document = "The quick brown fox jumps over the lazy dog near the river bank. " * 20  # shorter than asked
    texts = with_document(tokenizer, document, 600, ["First question?", "Second question?"])
    assert texts[0].endswith("\n\nFirst question?") and texts[1].endswith("\n\nSecond question?")
    assert all(590 <= len(tokenizer.encode(t)) <= 610 for t in texts)
    assert texts[0][:40] != texts[1][:40]


def test_without_the_cpp_server_the_python_server_is_the_labelled_fallback():
    rows = [served.Series("tandem int8", [100.0]), served.Series(served.LlamaCppServer.NAME, [80.0])]
    lines = served_table(rows).splitlines()
    assert lines[0].split()[4] == "/llama-cpp-python"
    assert lines[1].split() == ["tandem", "int8", "100.0", "1.25x"]
    assert lines[2].split()[:3] == ["llama-cpp-python", "server", "(fallback)"]


def test_http_names_a_llama_server_path_that_is_not_there(tmp_path, capsys):
    from bench.compare import main
    assert main(["--http", "--llama-server", str(tmp_path / "nowhere")]) == 2
    assert f"--llama-server {tmp_path / 'nowhere'}: no such file" in capsys.readouterr().out


def test_busy_loops_spin_at_nice_19_beside_the_servers_and_stop():
    from bench.processes import BusyLoops, alive, wait_until
    with BusyLoops(2) as busy:
        pids = [p.pid for p in busy.procs]
        assert [os.getpriority(os.PRIO_PROCESS, pid) for pid in pids] == [19, 19]
        # utime (clock ticks in user mode), the 14th field of /proc/PID/stat: they spin
        wait_until(lambda: all(int(open(f"/proc/{pid}/stat").read().split()[13]) > 0 for pid in pids), 10,
                   "the loops to use the CPU")
    assert not any(alive(pid) for pid in pids)
