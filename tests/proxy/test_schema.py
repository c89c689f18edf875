"""The proxy's /openapi.json and /docs: open with --api-key, and every error documented in the
OpenAI shape, as the server's."""
from __future__ import annotations

import sys

import httpx

KEY = "sekrit"


def test_schema_and_docs_are_open_and_the_api_needs_the_key(make_proxy, tmp_path_factory):
    script = tmp_path_factory.mktemp("never") / "never_healthy.py"
    script.write_text("import time; time.sleep(120)\n")
    proxy = make_proxy({"slow": {"args": ["-m", "x"], "command": [sys.executable, str(script)]}}, api_key=KEY)
    schema = httpx.get(proxy.url + "/openapi.json").json()
    jobs = schema["paths"]["/jobs"]["post"]
    assert {"400", "401", "404", "503"} <= jobs["responses"].keys() and "422" not in jobs["responses"]
    assert jobs["responses"]["401"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorResponse")
    docs = httpx.get(proxy.url + "/docs")
    assert docs.status_code == 200 and "openapi.json" in docs.text
    assert httpx.get(proxy.url + "/jobs").status_code == 401
    assert httpx.get(proxy.url + "/jobs", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200
