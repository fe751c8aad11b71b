"""Grammars of constrained decoding: what llguidance lets through, token by token.

The reference is the grammar's own meaning: the compact JSON that must pass, and the same
JSON with free whitespace, which a small model could otherwise repeat until ``max_tokens``.
"""

from __future__ import annotations

import json

import llguidance
import pytest

from qfserve.engine.models.loading import default_model_path, load_model
from qfserve.engine.text.structured import (
    ToolCallConstraint,
    _ll_tokenizer,
    compile_grammar,
    compile_tool_grammar,
    strict_schema,
)

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"name": "get_weather", "parameters": SCHEMA}, {"name": "get_time", "parameters": {}}]


@pytest.fixture(scope="module")
def tokenizer():
    loaded = load_model(str(default_model_path()))
    return loaded.tokenizer, _ll_tokenizer(loaded.tokenizer, loaded.model.args.vocab_size)


def accepts(tokenizer, grammar: str, text: str) -> bool:
    tok, ll = tokenizer
    matcher = llguidance.LLMatcher(ll, grammar)
    ids = tok.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and not matcher.get_error()


@pytest.mark.parametrize(
    ("grammar", "compact", "spaced"),
    [
        (
            lambda: compile_tool_grammar(json.dumps(TOOLS)),
            '<tool_call>{"name":"get_weather","arguments":{"city":"x"}}</tool_call>',
            '<tool_call>{"name":  "get_weather","arguments":{"city":"x"}}</tool_call>',
        ),
        (lambda: compile_grammar(json.dumps(SCHEMA)), '{"city":"x"}', '{"city":   "x"}'),
    ],
    ids=["tool-call", "response-format"],
)
def test_json_is_compact_so_whitespace_cannot_run_on(tokenizer, grammar, compact, spaced):
    g = grammar()
    assert accepts(tokenizer, g, compact)
    assert not accepts(tokenizer, g, spaced)


NESTED = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}}},
        "stops": {"type": "array", "items": {"properties": {"name": {"type": "string"}}}},
        "pair": {"type": "array", "prefixItems": [{"type": "integer"}]},
        "either": {"anyOf": [{"type": "object", "properties": {"a": {"type": "integer"}}}]},
        "open": {"type": "object", "additionalProperties": True},
        "typed": {"type": "object", "additionalProperties": {"type": "integer"}},
    },
    "required": ["city"],
}
DECLARED = {
    "city": "x",
    "where": {"lat": 1},
    "stops": [{"name": "a"}],
    "pair": [1],
    "either": {"a": 1},
    "open": {"anything": [1, {"b": 2}]},
    "typed": {"n": 3},
}
UNDECLARED = [  # each adds one thing NESTED does not declare
    {"city": "x", "type": "object"},
    {"city": "x", "where": {"lat": 1, "lon": 2}},
    {"city": "x", "stops": [{"name": "a", "extra": 1}]},
    {"city": "x", "pair": [1, 2]},
    {"city": "x", "either": {"a": 1, "b": 2}},
]


def test_a_strict_schema_refuses_what_it_does_not_declare():
    """jsonschema is the reference: the original schema takes every instance, the strict one
    only those that add nothing undeclared, and it keeps what the schema opened explicitly."""
    jsonschema = pytest.importorskip("jsonschema")
    strict = strict_schema(NESTED)
    jsonschema.validate(DECLARED, NESTED)
    jsonschema.validate(DECLARED, strict)
    for instance in UNDECLARED:
        jsonschema.validate(instance, NESTED)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(instance, strict)
    assert NESTED["properties"]["where"] == {  # the input is not changed
        "type": "object",
        "properties": {"lat": {"type": "number"}},
    }
    both = {"allOf": [{"properties": {"a": {}}}, {"properties": {"b": {}}}]}
    assert strict_schema(both) == both  # closing a branch would refuse the other's property


def test_forced_tool_calls_take_no_undeclared_arguments_unless_told(tokenizer):
    """The schema most clients send (no additionalProperties): a call adding a property is
    refused under the default strict compilation, and let through with ``strict: false``."""
    spec = [{"name": "get_weather", "parameters": SCHEMA}]
    call = '<tool_call>{"name":"get_weather","arguments":{"city":"x"%s}}</tool_call>'
    strict = ToolCallConstraint.of(spec).grammar()
    lenient = ToolCallConstraint.of([{**spec[0], "strict": False}]).grammar()
    assert accepts(tokenizer, strict, call % "")
    assert not accepts(tokenizer, strict, call % ',"type":"object"')
    assert accepts(tokenizer, lenient, call % ',"type":"object"')
    bare = ToolCallConstraint.of([{"name": "now", "parameters": None}]).grammar()
    assert accepts(tokenizer, bare, '<tool_call>{"name":"now","arguments":{}}</tool_call>')
    assert not accepts(tokenizer, bare, '<tool_call>{"name":"now","arguments":{"a":1}}</tool_call>')
