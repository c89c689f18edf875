"""--log-level and --log-format, for the server and the proxy (both set logging up with server.logs)."""
from __future__ import annotations

import json
import logging
import subprocess
import sys

import httpx
import pytest

from server.logs import JsonLines
from tests.server.helpers import ROOT


def test_json_lines_carry_time_level_logger_message_and_extra_fields():
    record = logging.LogRecord("tandem.server", logging.WARNING, __file__, 1, "slot %d busy", (3,), None)
    record.request_id = "r1"
    line = json.loads(JsonLines().format(record))
    assert line.keys() == {"time", "level", "logger", "message", "request_id"}
    assert (line["level"], line["logger"], line["message"], line["request_id"]) == \
        ("warning", "tandem.server", "slot 3 busy", "r1")


def test_a_server_with_log_format_json_writes_json_lines_with_an_access_line(start_server, tiny_model):
    server = start_server(["-m", str(tiny_model), "-c", "2048", "--log-format", "json", "--log-level", "info"])
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "abc", "max_tokens": 2}).status_code == 200
    server.kill()
    lines = [json.loads(line) for line in server.log_path.read_text().splitlines() if line.strip()]
    assert all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
    assert any(line["logger"] == "tandem.server" and "model loaded" in line["message"] for line in lines)
    assert not any(line["logger"] == "uvicorn.error" and line["level"] == "info" for line in lines)
    access = [line for line in lines if line["logger"] == "uvicorn.access" and line.get("path") == "/v1/completions"]
    assert access and access[0]["method"] == "POST" and access[0]["status"] == 200 and access[0]["level"] == "info"


@pytest.mark.parametrize("module,argv,message", [
    ("server", ["--log-level", "loud"], "--log-level='loud': must be one of debug, info, warning, error"),
    ("server", ["--log-format", "xml"], "--log-format='xml': must be one of text, json"),
    ("proxy", ["--log-level", "loud"], "argument --log-level: invalid choice: 'loud'"),
    ("proxy", ["--log-format", "xml"], "argument --log-format: invalid choice: 'xml'"),
])
def test_a_bad_log_flag_exits_2_naming_it(module, argv, message):
    done = subprocess.run([sys.executable, "-m", module, *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr
