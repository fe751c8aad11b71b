"""Every parameter of OpenAI's chat and text completions references has its documented fate
(``qfserve.server.compat``): implemented ones are accepted and act, no-ops change no token of the
answer, refused ones are a 400 naming them; ``null`` is the default for every optional one."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import pytest

from qfserve.server.compat import CHAT_FATES, COMPLETION_FATES, REQUIRED
from tests.server.conftest import MODEL_NAME

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"
MESSAGES = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
BASE = {
    "chat": {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 6, "temperature": 0},
    "completions": {
        "model": MODEL_NAME,
        "prompt": "Pack my box with",
        "max_tokens": 6,
        "temperature": 0,
    },
}
# A value with an effect for each parameter that is not required.
SAMPLES = {
    "audio": {"voice": "alloy", "format": "wav"},
    "frequency_penalty": 0.5,
    "function_call": "auto",
    "functions": [{"name": "f", "parameters": {"type": "object"}}],
    "logit_bias": {"5": 1.0},
    "logprobs": True,
    "max_completion_tokens": 5,
    "max_tokens": 5,
    "metadata": {"purpose": "test"},
    "modalities": ["text"],
    "n": 1,
    "parallel_tool_calls": True,
    "prediction": {"type": "content", "content": "a fox"},
    "presence_penalty": 0.5,
    "prompt_cache_key": "abc",
    "reasoning_effort": "low",
    "response_format": {"type": "json_object"},
    "safety_identifier": "user-1",
    "seed": 7,
    "service_tier": "auto",
    "stop": ["zzz"],
    "store": True,
    "stream": False,
    "stream_options": None,
    "temperature": 0.0,
    "tool_choice": "none",
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "top_logprobs": None,
    "top_p": 0.9,
    "user": "someone",
    "verbosity": "low",
    "web_search_options": {"search_context_size": "low"},
    "best_of": 1,
    "echo": True,
    "suffix": " the end",
}
COMPLETION_SAMPLES = {**SAMPLES, "logprobs": 2}
CASES = [("chat", n, f) for n, (f, _) in CHAT_FATES.items() if n not in REQUIRED] + [
    ("completions", n, f) for n, (f, _) in COMPLETION_FATES.items() if n not in REQUIRED
]


def post(server, endpoint: str, body: dict) -> httpx.Response:
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    return httpx.post(server.url + path, json=body, timeout=60)


def text_of(endpoint: str, body: dict) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if endpoint == "chat" else choice["text"]


@pytest.mark.parametrize(("endpoint", "name", "fate"), CASES, ids=[f"{e}-{n}" for e, n, _ in CASES])
def test_parameter_has_its_documented_fate(server, endpoint, name, fate):
    base = dict(BASE[endpoint])
    if endpoint == "chat" and name == "max_tokens":  # keep the answer short either way
        base["max_completion_tokens"] = base.pop("max_tokens")
    plain = post(server, endpoint, base)
    assert plain.status_code == 200
    without = {k: v for k, v in base.items() if k != name}
    nulled = post(server, endpoint, {**without, name: None})
    assert nulled.status_code == 200, nulled.text  # null means the default
    if name != "temperature":  # the default temperature samples
        default = post(server, endpoint, without)
        assert text_of(endpoint, nulled.json()) == text_of(endpoint, default.json())
    sample = (SAMPLES if endpoint == "chat" else COMPLETION_SAMPLES)[name]
    resp = post(server, endpoint, {**base, name: sample})
    if fate == "refused":
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == name and "not supported" in error["message"]
        assert httpx.get(server.url + "/health").status_code == 200
        return
    assert resp.status_code == 200, resp.text
    if fate == "no-op":
        assert text_of(endpoint, resp.json()) == text_of(endpoint, plain.json())


def test_implemented_sampler_extensions_act(server):
    base = {**BASE["completions"], "temperature": 1.0, "seed": 3, "max_tokens": 12}
    greedy = post(server, "completions", {**BASE["completions"], "max_tokens": 12}).json()
    top1 = post(server, "completions", {**base, "top_k": 1}).json()
    assert text_of("completions", top1) == text_of("completions", greedy)  # top_k=1 is greedy
    strict_min_p = post(server, "completions", {**base, "min_p": 1.0}).json()
    assert text_of("completions", strict_min_p) == text_of("completions", greedy)
    loose = post(server, "completions", {**base, "repetition_penalty": 1.0}).json()
    penalised = post(server, "completions", {**base, "repetition_penalty": 5.0}).json()
    assert text_of("completions", loose) != text_of("completions", penalised)
    for name, value in (("top_k", -1), ("min_p", 1.5), ("repetition_penalty", 0)):
        resp = post(server, "completions", {**base, name: value})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == name


def test_extension_fields_stay_strict(server):
    resp = post(server, "chat", {**BASE["chat"], "qfilters_budgte": 64})
    assert resp.status_code == 400 and "qfilters_budgte" in resp.json()["error"]["message"]


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
    },
    "required": ["name", "count"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_output_validates_with_eviction_active(server, endpoint, stream):
    body = {
        **BASE[endpoint],
        "max_tokens": 64,
        "temperature": 0.8,
        "seed": 11,
        "stream": stream,
        "qfilters_budget": 16,
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "thing", "schema": SCHEMA},
        },
    }
    resp = post(server, endpoint, body)
    assert resp.status_code == 200, resp.text
    if stream:
        events = [e[6:] for e in resp.text.split("\n\n") if e.startswith("data: ")]
        chunks = [json.loads(e) for e in events if e != "[DONE]"]
        key = "delta" if endpoint == "chat" else None
        text = "".join(
            (c["choices"][0][key].get("content") or "") if key else c["choices"][0]["text"]
            for c in chunks
            if c["choices"]
        )
    else:
        text = text_of(endpoint, resp.json())
    jsonschema.validate(json.loads(text), SCHEMA)


def test_a_schema_the_grammar_engine_cannot_compile_is_a_400(server):
    bad = {"type": "string", "pattern": "(?<=a)b"}
    body = {
        **BASE["chat"],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": bad}},
    }
    resp = post(server, "chat", body)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == "response_format"
