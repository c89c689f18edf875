"""Requests generated from the server's own /openapi.json (schemathesis's strategies, drawn by
hypothesis): whatever a body the schema admits holds, the server answers it without a 5xx and
stays up."""
from __future__ import annotations

import time

import httpx
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings, strategies as st

EXAMPLES = 120
BUDGET_S = 90  # examples past it are not sent


def test_requests_generated_from_the_schema_get_no_server_error(start_server, tiny_model):
    # 128 positions a slot and a 1 s time limit keep every generation short, whatever max_tokens says.
    server = start_server(["-m", str(tiny_model), "-c", "256", "-np", "2", "--timeout", "1"])
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10
    failures: list[str] = []
    answered: list[int] = []
    t0 = time.monotonic()

    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.one_of(*[op.as_strategy() for op in operations]))
    def answer(case):
        if time.monotonic() - t0 > BUDGET_S:
            return
        response = case.call(base_url=server.url, timeout=30)
        answered.append(response.status_code)
        if response.status_code >= 500:
            failures.append(f"{case.method} {case.path} {case.body!r}: {response.status_code} {response.text[:300]}")

    answer()
    assert not failures, "\n".join(failures[:10])
    assert len(answered) >= EXAMPLES // 2, f"only {len(answered)} requests fit {BUDGET_S} s"
    assert answered.count(200) >= EXAMPLES // 4  # the schema leads most bodies past validation
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200
