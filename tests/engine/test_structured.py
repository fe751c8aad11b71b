"""Grammars of constrained decoding: what llguidance lets through, token by token.

The reference is the grammar's own meaning: the compact JSON that must pass, and the same
JSON with free whitespace, which a small model could otherwise repeat until ``max_tokens``.
"""

from __future__ import annotations

import json

import llguidance
import pytest

from qfserve.engine.models.loading import default_model_path, load_model
from qfserve.engine.text.structured import _ll_tokenizer, compile_grammar, compile_tool_grammar

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
