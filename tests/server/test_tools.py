"""Tool calling: a template that renders tools gets them; ``<tool_call>`` blocks come back as
OpenAI ``tool_calls`` (checked with the official SDK's strict parser); a forced call is
constrained decoding, so even a random-weight model produces a valid one."""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from qfserve.engine.text.tools import parse_tool_calls, without_open_call
from qfserve.server.openapi import ChatCompletion, ChatCompletionChunk, Completion, CompletionChunk
from tests.server.conftest import MODEL_NAME, start_server, stop_server
from tests.tiny import TOOL_CHAT_TEMPLATE, save_tiny_model

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "pattern": "^[a-z]{1,8}$"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory):
    model = save_tiny_model(
        tmp_path_factory.mktemp("models") / MODEL_NAME, chat_template=TOOL_CHAT_TEMPLATE
    )
    server = start_server(model, tmp_path_factory.mktemp("logs") / "tools.log")
    yield server
    stop_server(server)


def test_forced_tool_call_is_parsed(tool_server):
    resp = tool_server.client().chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0.7,
        seed=1,
        max_tokens=200,
        extra_body={"qfilters_budget": 16},
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER["function"]["parameters"])


def test_forced_tool_call_streams(tool_server):
    stream = tool_server.client().chat.completions.create(
        model=MODEL_NAME,
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=200,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [c.function.name for c in calls] == ["get_weather"]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_a_forced_call_cut_by_max_tokens_is_no_answer(tool_server, stream):
    """A call max_tokens cut is neither a call nor the answer's content: ``length``, no
    ``tool_calls``, no half-written ``<tool_call>`` text."""
    kwargs = dict(
        model=MODEL_NAME,
        messages=MESSAGES,
        tools=[WEATHER],
        tool_choice="required",
        temperature=0,
        max_tokens=6,
    )
    client = tool_server.client()
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        content = "".join(d.content or "" for d in deltas)
        calls = [t for d in deltas for t in d.tool_calls or ()]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        content, calls, finish = (
            choice.message.content or "",
            choice.message.tool_calls,
            choice.finish_reason,
        )
    assert finish == "length"
    assert not calls
    assert "<tool_call" not in content and content == ""


def test_an_unclosed_call_is_cut_from_the_content():
    assert without_open_call('Sure. <tool_call>{"name": "get_w') == "Sure."
    assert without_open_call('<tool_call>{"name": "get_w') is None
    closed = '<tool_call>{"name": "a"}</tool_call> then'
    assert without_open_call(closed) == closed
    assert without_open_call("no call") == "no call"
    assert without_open_call("<tool_") is None and without_open_call("Sure <t") == "Sure"
    assert without_open_call("a < b") == "a < b"


def test_history_with_tool_calls_and_results_is_rendered(tool_server):
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },  # fmt: skip
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    resp = tool_server.client().chat.completions.create(
        model=MODEL_NAME, messages=history, tools=[WEATHER], max_tokens=4, temperature=0
    )
    assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_a_template_without_tool_support_gets_the_generic_format(server):
    """The bundled model's template ignores tools: they are described in a system message,
    and a forced call is still decoded under the grammar and parsed by the SDK."""
    client = server.client()
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        resp = client.chat.completions.create(
            model=MODEL_NAME,
            messages=MESSAGES,
            tools=[WEATHER],
            tool_choice=choice,
            max_tokens=200,
            temperature=0,
        )
        assert resp.choices[0].finish_reason == "tool_calls"
        (call,) = resp.choices[0].message.tool_calls
        assert call.function.name == "get_weather"
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # A history with calls and results renders too (written back in the same convention).
    history = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    resp = client.chat.completions.create(
        model=MODEL_NAME, messages=history, tools=[WEATHER], max_tokens=4, temperature=0
    )
    assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")


_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "paris"}'},
}


def test_generic_tool_messages_describe_the_tools_and_write_back_calls():
    from qfserve.engine.text.tools import generic_tool_messages

    out = generic_tool_messages(
        [
            {"role": "system", "content": "Be brief."},
            *MESSAGES,
            {"role": "assistant", "content": None, "tool_calls": [_CALL]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
        [WEATHER],
    )
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]
    system = out[0]["content"]
    assert system.startswith("Be brief.") and "get_weather: Weather in a city" in system
    assert json.dumps(WEATHER["function"]["parameters"], separators=(",", ":")) in system
    written = out[2]["content"]
    assert written.startswith("<tool_call>") and written.endswith("</tool_call>")
    content, (call,) = parse_tool_calls(written)
    assert content is None and json.loads(call["function"]["arguments"]) == {"city": "paris"}
    assert out[3]["content"] == "Result of call_1: sunny"
    # No system message: one is added in front.
    assert generic_tool_messages(MESSAGES, [WEATHER])[0]["role"] == "system"


def test_parse_tool_calls_keeps_the_rest_as_content():
    text = 'Let me check. <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call> <tool_call>nope</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content == "Let me check.  <tool_call>nope</tool_call>"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("f", {"x": 1})
    ]
    assert parse_tool_calls("plain") == ("plain", [])
    # Without tags, a whole answer naming one of the request's tools is a call; else text.
    bare = '{"name": "f", "arguments": {"x": 2}}'
    assert parse_tool_calls(bare) == (bare, [])
    assert parse_tool_calls(bare, ("g",)) == (bare, [])
    content, (call,) = parse_tool_calls(f" {bare}\n", ("f",))
    assert content is None and json.loads(call["function"]["arguments"]) == {"x": 2}


def _post(server, path: str, body: dict) -> httpx.Response:
    resp = httpx.post(f"{server.url}{path}", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp


def _events(resp: httpx.Response) -> list[dict]:
    data = [line[len("data: ") :] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def test_sent_bodies_are_the_documented_response_models(tool_server):
    """The OpenAPI document's models forbid undeclared fields, so a body the code builds
    that drifts from them (a tool call, a finish reason) fails here."""
    forced = {
        "model": MODEL_NAME,
        "messages": MESSAGES,
        "tools": [WEATHER],
        "tool_choice": "required",
        "max_tokens": 200,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    body = _post(tool_server, "/v1/chat/completions", forced).json()
    assert ChatCompletion.model_validate(body).choices[0].finish_reason == "tool_calls"
    stream = {**forced, "stream": True, "stream_options": {"include_usage": True}}
    chunks = [
        ChatCompletionChunk.model_validate(e)
        for e in _events(_post(tool_server, "/v1/chat/completions", stream))
    ]
    assert any(c.choices and c.choices[0].delta.tool_calls for c in chunks)
    plain = {"model": MODEL_NAME, "messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    ChatCompletion.model_validate(_post(tool_server, "/v1/chat/completions", plain).json())
    text = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "logprobs": 2}
    Completion.model_validate(_post(tool_server, "/v1/completions", text).json())
    for event in _events(_post(tool_server, "/v1/completions", {**text, "stream": True})):
        CompletionChunk.model_validate(event)
