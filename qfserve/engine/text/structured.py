"""Structured output: a JSON schema as a per-token mask, through llguidance.

llguidance (the grammar engine llama.cpp and vLLM use) owns the grammar: it compiles a JSON
schema, and after every token says which tokens may come next. The mask is applied as an
mlx-lm logits processor, like mlx-lm's own processors, so the generation loop, the sampler and
the eviction caches are unchanged. EOS is allowed exactly when the JSON is complete, and
is then the only token allowed.

llguidance's MLX helper applies the mask with a Metal kernel only; the bitmask is unpacked
with numpy here instead, which every backend runs (49,152 bits a step for SmolLM2).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np


class GrammarError(ValueError):
    """A schema llguidance cannot compile; the message says why."""


@dataclass(frozen=True)
class JSONConstraint:
    """What a response must be: any JSON object (``schema`` is None) or one matching ``schema``.

    Args:
        schema: A JSON schema, serialised (kept as text so the dataclass stays hashable).
    """

    schema: str | None = None

    def grammar(self) -> str:
        """The llguidance grammar; raises :class:`GrammarError` if it does not compile."""
        return compile_grammar(self.schema)


@dataclass(frozen=True)
class ToolCallConstraint:
    """The answer must be one ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    block calling one of ``tools`` with arguments of its parameters schema.

    Args:
        tools: ``[{"name": ..., "parameters": {...}}, ...]``, serialised.
    """

    tools: str

    @classmethod
    def of(cls, tools: list[dict[str, Any]]) -> ToolCallConstraint:
        """The constraint for ``[{"name", "parameters", "strict"}, ...]``: each parameters
        schema compiled strictly (:func:`strict_schema`) unless its tool says
        ``strict: false``."""
        spec = [
            {
                "name": t["name"],
                "parameters": t.get("parameters")
                if t.get("strict") is False
                else strict_schema(t.get("parameters") or {"type": "object"}),
            }
            for t in tools
        ]
        return cls(json.dumps(spec))

    def grammar(self) -> str:
        return compile_tool_grammar(self.tools)


Constraint = JSONConstraint | ToolCallConstraint

# Keywords whose value is one sub-schema, a list of them, or a map of names to them.
_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else")
_MANY = ("prefixItems", "anyOf", "oneOf")
_NAMED = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def strict_schema(schema: Any) -> Any:
    """``schema`` with nothing allowed that it does not declare, as OpenAI's and vLLM's strict
    mode compile it: an object schema that does not say ``additionalProperties`` (nor
    ``patternProperties`` or ``unevaluatedProperties``) takes only its ``properties``, and a
    tuple (``prefixItems``) that does not say ``items`` only its items.

    JSON Schema's own default allows any undeclared property, and a small model forced to
    call a tool whose schema leaves them open writes property after property until
    ``max_tokens``. ``allOf`` branches are left as written: closing each would refuse what
    the others declare.
    """
    if isinstance(schema, list):
        return [strict_schema(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict | list):
            out[key] = strict_schema(out[key])
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [strict_schema(s) for s in out[key]]
    for key in _NAMED:
        if isinstance(out.get(key), dict):
            out[key] = {name: strict_schema(s) for name, s in out[key].items()}
    kinds = out.get("type")
    is_object = (
        "properties" in out or kinds == "object" or (isinstance(kinds, list) and "object" in kinds)
    )
    open_keys = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if is_object and not any(k in out for k in open_keys):
        out["additionalProperties"] = False
    if "prefixItems" in out and "items" not in out and "unevaluatedItems" not in out:
        out["items"] = False
    return out


@lru_cache(maxsize=64)
def compile_tool_grammar(tools: str) -> str:
    """A Lark grammar (llguidance's dialect, JSON embedded with ``%json``) for one tool call."""
    import llguidance

    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": t["name"]},
                "arguments": t.get("parameters") or {"type": "object"},
            },
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in json.loads(tools)
    ]
    spec = {"anyOf": calls} if len(calls) > 1 else calls[0]
    # Compact JSON, as for response formats: %json alone lets whitespace repeat forever.
    spec = {**spec, "x-guidance": {"whitespace_flexible": False}}
    grammar = llguidance.LLMatcher.grammar_from_lark(
        f'start: "<tool_call>" call "</tool_call>"\ncall: %json {json.dumps(spec)}'
    )
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(f"the tools' parameters cannot be compiled: {error}")
    return str(grammar)


@lru_cache(maxsize=64)
def compile_grammar(schema: str | None) -> str:
    """The llguidance grammar of a serialised schema (``None``: any JSON object).

    Raises:
        GrammarError: the schema is not valid JSON, or llguidance cannot compile it.
    """
    import llguidance

    try:
        spec: Any = {"type": "object"} if schema is None else json.loads(schema)
    except ValueError as exc:
        raise GrammarError(f"the schema is not valid JSON: {exc}") from None
    # Compact JSON: no free whitespace for a small model to wander in.
    try:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(
            spec, defaults={"whitespace_flexible": False}
        )
    except (TypeError, ValueError) as exc:
        raise GrammarError(f"the schema cannot be compiled: {exc}") from None
    error = llguidance.LLMatcher.validate_grammar(grammar)  # "" when it compiles
    if error:
        raise GrammarError(f"the schema cannot be compiled: {error}")
    return str(grammar)


@lru_cache(maxsize=4)
def _ll_tokenizer(tokenizer: Any, n_vocab: int) -> Any:
    import llguidance.hf

    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    eos = sorted(getattr(tokenizer, "eos_token_ids", None) or [hf.eos_token_id])
    return llguidance.hf.from_tokenizer(hf, n_vocab=n_vocab, eos_token=eos)


class GrammarProcessor:
    """An mlx-lm logits processor that allows only tokens the grammar accepts next.

    mlx-lm calls it as ``processor(tokens, logits)`` before sampling each token, with every
    token so far; the tokens added since the last call are fed to the grammar first.
    """

    def __init__(self, tokenizer: Any, constraint: JSONConstraint | ToolCallConstraint) -> None:
        self.tokenizer = tokenizer
        self.grammar = constraint.grammar()
        self.matcher: Any = None
        self._seen = 0

    def _start(self, n_vocab: int) -> None:
        import llguidance
        import llguidance.numpy as lnp

        # The model's vocabulary (its logits' width) may be padded beyond the tokenizer's.
        ll = _ll_tokenizer(self.tokenizer, n_vocab)
        self.matcher = llguidance.LLMatcher(ll, self.grammar)
        self.mask = lnp.allocate_token_bitmask(1, ll.vocab_size)
        self._fill = lnp.fill_next_token_bitmask

    def __call__(self, tokens: Any, logits: Any) -> Any:
        import mlx.core as mx

        if self.matcher is None:  # the first call sees the prompt only
            self._start(logits.shape[-1])
            self._seen = tokens.size
        else:
            for token in tokens[self._seen :].tolist():  # only the new ones leave the device
                self.matcher.consume_token(token)
            self._seen = tokens.size
        if self.matcher.is_error():
            raise RuntimeError(f"constrained decoding failed: {self.matcher.get_error()}")
        self._fill(self.matcher, self.mask, 0)
        bits = np.unpackbits(self.mask.view(np.uint8), bitorder="little")
        allowed = mx.array(bits[: logits.shape[-1]].astype(np.bool_))
        return mx.where(allowed, logits, -mx.inf)
