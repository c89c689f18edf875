"""The wire models: importable without torch, and their validation names the field."""
import subprocess
import sys

import pytest
from pydantic import BaseModel, ConfigDict, ValidationError

from server.protocol import ChatCompletionRequest, CompletionRequest, error_body, validation_problems
from tests.server.helpers import ROOT


def test_protocol_imports_without_torch_or_engine():
    code = "import sys, server.protocol; bad = {'torch', 'engine'} & set(sys.modules); assert not bad, bad"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_error_shape_is_openais():
    assert error_body(503, "Loading model") == {"error": {"code": 503, "message": "Loading model",
                                                          "type": "unavailable_error"}}


def test_validation_problems_name_the_field_and_the_rule_one_line_each():
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=0, top_k="many")
    assert validation_problems(e.value.errors()) == [
        "max_tokens: Input should be greater than or equal to 1",
        "top_k: Input should be a valid integer, unable to parse string as an integer"]
    with pytest.raises(ValidationError) as e:
        CompletionRequest()
    assert validation_problems(e.value.errors()) == ["prompt: field required"]


def test_validation_problems_word_malformed_json_and_unknown_keys():
    with pytest.raises(ValidationError) as e:
        ChatCompletionRequest.model_validate_json('{"messages": [')
    [problem] = validation_problems(e.value.errors())
    assert problem.startswith("malformed JSON: ")

    class Strict(BaseModel):
        model_config = ConfigDict(extra="forbid")
        x: int = 0

    with pytest.raises(ValidationError) as e:
        Strict(y=1)
    assert validation_problems(e.value.errors()) == ["y: unknown key"]


@pytest.mark.parametrize("extra,field", [
    ({"seed": 2**64}, "seed"), ({"logit_bias": [[1.7, 5]]}, "logit_bias"), ({"n": 3}, "n"),
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


def test_sampling_ranges_are_left_to_the_engine():
    """SamplingParams holds the ranges (the server turns its error into a 400); the wire model
    checks types and shapes only."""
    r = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], temperature=-1, top_p=0,
                              repeat_penalty=0, presence_penalty=float("inf"))
    assert (r.temperature, r.top_p, r.repeat_penalty) == (-1, 0, 0)


@pytest.mark.parametrize("body,problem", [
    ({"prompt": "a\ud800b"}, "prompt: not valid Unicode text (a lone surrogate at character 1)"),
    ({"prompt": "a", "logit_bias": [[float("inf"), 5]]}, "logit_bias: token id inf is not an integer"),
    ({"prompt": "a", "logit_bias": [[1.7, 5]]}, "logit_bias: token id 1.7 is not an integer"),
    ({"prompt": "a", "logit_bias": [[1, 5, 6]]}, "logit_bias: each entry must be a [token id, bias] pair"),
    ({"prompt": "a", "logit_bias": {"x": 1}}, "logit_bias: key 'x' is not a token id"),
    ({"prompt": "a", "logit_bias": {"1": float("nan")}},
     "logit_bias: bias nan must be a finite number (or -Infinity, a ban)"),
    ({"prompt": "a", "seed": 2**64}, "seed: Input should be less than 18446744073709551616"),
    ({"prompt": "a", "seed": -2**63 - 1}, "seed: Input should be greater than or equal to -9223372036854775808"),
    ({"prompt": "a", "speculative.n_max": -1}, "speculative.n_max: must be >= 0 (0 drafts nothing), got -1"),
    ({"prompt": "a", "speculative.n_min": -2}, "speculative.n_min: must be >= 0 (0 drafts nothing), got -2"),
    ({"prompt": "a", "speculative.p_min": 1.5}, "speculative.p_min: must be in [0, 1], got 1.5"),
    ({"prompt": "a", "speculative.p_min": float("nan")}, "speculative.p_min: must be in [0, 1], got nan"),
    ({"prompt": "a", "speculative.n_max": 2, "speculative.n_min": 3},
     "speculative.n_min: must be in 0..speculative.n_max=2, got 3"),
    ({"prompt": "a", "speculative.n_max": "many"},
     "speculative.n_max: Input should be a valid integer, unable to parse string as an integer"),
])
def test_refusals_name_the_field(body, problem):
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate(body)
    assert validation_problems(e.value.errors()) == [problem]


def test_speculation_limits_read_llama_servers_flat_keys():
    r = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "speculative.n_max": 0,
                                              "speculative.n_min": 0, "speculative.p_min": 1})
    assert (r.spec_n_max, r.spec_n_min, r.spec_p_min) == (0, 0, 1.0) and not r.model_extra
    assert (CompletionRequest(prompt="a").spec_n_max, CompletionRequest(prompt="a").spec_p_min) == (None, None)
    schema = CompletionRequest.model_json_schema()["properties"]
    assert schema["speculative.n_max"]["minimum"] == 0 and schema["speculative.p_min"]["maximum"] == 1


def test_logit_bias_forms_give_integer_ids():
    assert CompletionRequest(prompt="a", logit_bias=[[1.0, 5], [2, float("-inf")]]).bias_pairs() == \
        [(1, 5.0), (2, float("-inf"))]
    assert CompletionRequest(prompt="a", logit_bias={"7": -1}).bias_pairs() == [(7, -1.0)]


def test_completion_prompt_forms():
    assert CompletionRequest(prompt=[1, 2, 3]).prompt == [1, 2, 3]
    assert CompletionRequest(prompt=["one"]).prompt == "one"
    with pytest.raises(ValidationError):
        CompletionRequest(prompt="")
