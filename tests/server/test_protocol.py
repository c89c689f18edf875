"""The wire models: importable without torch, and their validation names the field."""
import subprocess
import sys

import pytest
from pydantic import ValidationError

from server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from tests.server.helpers import ROOT


def test_protocol_imports_without_torch_or_engine():
    code = "import sys, server.protocol; bad = {'torch', 'engine'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_error_shape_is_openais():
    assert error_body(503, "Loading model") == {"error": {"code": 503, "message": "Loading model",
                                                          "type": "unavailable_error"}}


@pytest.mark.parametrize("extra,field", [
    ({"temperature": float("nan")}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 3}, "n"),
    ({"tools": [{"type": "function"}]}, "tools"), ({"stop": ["a"] * 5}, "stop"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
])
def test_chat_request_refuses_what_tandem_does_not_do(extra, field):
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **extra)
    assert field in str(e.value)


def test_chat_limits_and_logprobs():
    r = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                              max_completion_tokens=7, logprobs=True, top_logprobs=3, stop="x",
                              logit_bias={"5": -100})
    assert r.token_limit == 7 and r.n_logprobs == 3 and r.stop_strings == ["x"]
    assert r.bias_pairs() == [(5, -100.0)] and r.messages[0].text() == "hi"


def test_completion_prompt_forms():
    assert CompletionRequest(prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert CompletionRequest(prompt=["one"]).prompt == "one"
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="")
