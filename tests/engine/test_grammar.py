"""Constrained decoding: a request's tokens follow its grammar, greedy and sampled, with and without
speculation; greedy under a grammar with drafts equals greedy under the same grammar without; a
grammar that cannot be used is refused naming the field and the problem."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine.engine import Engine
from engine.sched.grammar import MAX_SOURCE, GrammarError, GrammarSpec
from engine.sched.request import Draft
from engine.sched.sampling import SamplingParams
from engine.settings import EngineConfig, SpecConfig
from tests.engine.runs import run_all
from tests.engine.test_qsa_engine import write_llama8_with_drafts

# Compact JSON (the schema's own llguidance options, x-guidance: no whitespace between tokens), so
# that the tiny random model, which likes newlines, spends its tokens on values; strings are
# bounded for the same reason.
SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 3, "maximum": 42},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 2},
        "where": {"type": "object", "properties": {"x": {"type": "boolean"}}, "required": ["x"],
                  "additionalProperties": False},
    },
    "required": ["colour", "count", "tags", "where"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False, "whitespace_pattern": None},
}
PROMPTS = [[(7 * i + j) % 250 + 3 for j in range(20 + 5 * i)] for i in range(3)]
GREEDY = SamplingParams(temperature=0, max_tokens=160)
SAMPLED = SamplingParams(temperature=1.0, max_tokens=160, seed=11)


@pytest.fixture(scope="module")
def llama8(tmp_path_factory):
    return write_llama8_with_drafts(tmp_path_factory.mktemp("llama8-grammar"))


@pytest.fixture(scope="module")
def plain(llama8):
    return Engine.load(EngineConfig(model=str(llama8), ctx_size=3 * 512, parallel=3))


def run(engine: Engine, spec: GrammarSpec, params: SamplingParams) -> list:
    return run_all(engine, PROMPTS, params, grammar=spec)


def answers(engine: Engine, requests) -> list[str]:
    return [engine.tokenizer.decode(r.output_ids) for r in requests]


def test_a_json_schema_answer_validates_and_ends_when_the_grammar_completes(plain):
    spec = GrammarSpec.json_schema(SCHEMA, "response_format")
    for params in (GREEDY, SAMPLED):
        requests = run(plain, spec, params)
        for request, text in zip(requests, answers(plain, requests)):
            jsonschema.validate(json.loads(text), SCHEMA)
            assert request.finish_reason == "stop", text


def test_gbnf_and_regex_grammars_shape_the_answer(plain):
    gbnf = GrammarSpec("gbnf", 'root ::= ("yes" | "no") ", " [0-9] [0-9]? "."', "grammar")
    for text in answers(plain, run(plain, gbnf, SAMPLED)):
        assert re.fullmatch(r"(yes|no), [0-9][0-9]?\.", text), text
    regex = GrammarSpec("regex", r"[A-Z][a-z]{2,5}( [a-z]{1,4}){2}!", "grammar")
    for text in answers(plain, run(plain, regex, GREEDY)):
        assert re.fullmatch(r"[A-Z][a-z]{2,5}( [a-z]{1,4}){2}!", text), text


DRAFTERS = {
    # The target with noise on every weight, drafting trees: its top tokens are often the target's.
    "draft-simple trees": lambda path: SpecConfig(pacing=False, type="draft-simple", draft_model=str(path / "noisy"),
                                                  n_max=4, p_min=0.0, width=3, p_sibling=0.0),
    # An untrained MTP layer: most drafts are refused by the grammar or rejected by the target.
    "draft-mtp chain": lambda path: SpecConfig(pacing=False, type="draft-mtp",
                                               draft_model=str(path / "draft.safetensors"), n_max=3, p_min=0.0),
}


@pytest.mark.parametrize("drafter", DRAFTERS)
def test_greedy_under_a_grammar_with_drafts_equals_greedy_under_it_without(llama8, plain, drafter):
    spec = GrammarSpec.json_schema(SCHEMA, "response_format")
    engine = Engine.load(EngineConfig(model=str(llama8), ctx_size=3 * 512, parallel=3, spec=DRAFTERS[drafter](llama8)))
    reference = run(plain, spec, GREEDY)
    speculative = run(engine, spec, GREEDY)
    assert [r.output_ids for r in speculative] == [r.output_ids for r in reference]
    assert sum(r.draft_n for r in speculative) > 0, "nothing was drafted: verification was not exercised"
    if drafter == "draft-simple trees":
        assert sum(r.draft_n_accepted for r in speculative) > 0, "no draft was kept"
    for request, text in zip(speculative, answers(engine, speculative)):
        jsonschema.validate(json.loads(text), SCHEMA)


def test_sampling_under_a_grammar_with_drafts_keeps_to_the_grammar(llama8):
    engine = Engine.load(EngineConfig(model=str(llama8), ctx_size=3 * 512, parallel=3,
                                      spec=DRAFTERS["draft-simple trees"](llama8)))
    spec = GrammarSpec.json_schema(SCHEMA, "response_format")
    requests = run(engine, spec, SAMPLED)
    for request, text in zip(requests, answers(engine, requests)):
        jsonschema.validate(json.loads(text), SCHEMA)
        assert request.finish_reason == "stop"
    assert sum(r.draft_n_accepted for r in requests) > 0


def test_a_draft_is_cut_at_its_first_refused_token_keeping_the_siblings_the_grammar_allows(plain):
    constraint = plain.grammars.constraint(GrammarSpec("regex", "ab[cd]e", "grammar"))
    a, b, c, d, e, x = (plain.tokenizer.encode(ch)[0] for ch in "abcdex")
    constraint.advance([a])
    q = torch.full((3, plain.model.config.vocab_size), 1.0 / plain.model.config.vocab_size)
    draft = constraint.cut(Draft([b, x, e], q, siblings=[(1, c), (1, x), (2, d)]))
    # x is refused at depth 1: the chain ends before it, its sibling c stands there, and the
    # sibling at depth 2 follows x, which is gone.
    assert (draft.tokens, draft.siblings, draft.cut, draft.drafted) == ([b], [(1, c)], True, 2)
    assert draft.q.shape[0] == 1 and torch.equal(draft.refused_q, q[1])
    whole = Draft([b, d, e])
    assert constraint.cut(whole) is whole
    masks = constraint.masks([[], [b], [b, d]])
    allowed = [set(torch.nonzero(m).flatten().tolist()) for m in masks]
    assert allowed == [{b}, {c, d}, {e}]
    constraint.advance([b, d, e])
    assert constraint.done


@pytest.mark.parametrize("spec, problem", [
    (GrammarSpec("json_schema", json.dumps({"type": "strng"}), "response_format.json_schema.schema"),
     "response_format.json_schema.schema: Invalid type: strng"),
    (GrammarSpec("gbnf", 'root ::= "a" | b', "grammar"), "grammar: Rule 'b' not found"),
    (GrammarSpec("regex", "(", "grammar"), "grammar: "),
    (GrammarSpec("lark", "x" * (MAX_SOURCE + 1), "grammar"), f"more than the {MAX_SOURCE} allowed"),
])
def test_a_grammar_that_cannot_be_used_is_refused_naming_the_field(plain, spec, problem):
    with pytest.raises(GrammarError) as e:
        plain.grammars.constraint(spec)
    assert str(e.value).startswith(problem) or problem in str(e.value)


def test_an_object_that_lists_its_properties_takes_no_others_unless_it_says_so(plain):
    def allows(schema: dict, text: str) -> bool:
        constraint = plain.grammars.constraint(GrammarSpec.json_schema(schema, "json_schema"))
        tokens = plain.tokenizer.encode(text)
        return constraint.matcher.validate_tokens(tokens) == len(tokens)

    listed = {"type": "object", "properties": {"a": {"type": "integer"},
                                               "properties": {"type": "object", "properties": {}}}}
    assert allows(listed, '{"a": 1}') and not allows(listed, '{"a": 1, "b": 2}')
    assert allows({**listed, "additionalProperties": True}, '{"a": 1, "b": 2}')
    assert allows({"type": "object"}, '{"b": 2}')


def test_a_request_preempted_under_a_grammar_resumes_where_its_matcher_is(llama8, plain):
    # Two requests sharing 160 positions, each 40 + up to 160: the younger is paused mid-answer,
    # recomputes, and goes on under the same matcher, drafting (a grammar-cut draft) as it resumes.
    spec = GrammarSpec.json_schema(SCHEMA, "response_format")
    pool = Engine.load(EngineConfig(model=str(llama8), ctx_size=160, parallel=2, kv_unified=True,
                                    spec=DRAFTERS["draft-simple trees"](llama8)))
    prompts = [[65] * 40, [66] * 40]
    got = run_all(pool, prompts, GREEDY, grammar=spec)
    assert pool.stats.preemptions > 0 and any(r.recomputed_n for r in got)
    alone = run_all(plain, prompts, GREEDY, grammar=spec)
    assert [r.output_ids for r in got] == [r.output_ids for r in alone]
    assert all(r.finish_reason == "stop" for r in got)


def test_greedy_takes_the_rows_argmax_where_allowed_without_making_the_mask(plain, monkeypatch):
    constraint = plain.grammars.constraint(GrammarSpec("regex", "ab[cd]e", "grammar"))
    a, b, c, d, x = (plain.tokenizer.encode(ch)[0] for ch in "abcdx")
    row = torch.zeros(plain.model.config.vocab_size)
    row[[x, d, c]] = torch.tensor([9.0, 5.0, 3.0])
    assert constraint.best(row, [a, b]) == d  # x is the argmax, refused after "ab": d is the best allowed
    row[c] = 10.0
    monkeypatch.setattr(constraint, "masks", lambda paths: pytest.fail("a mask was made for an allowed argmax"))
    assert constraint.best(row, [a, b]) == c
