"""Bad requests: each gets its status and OpenAI's error shape, and the server stays healthy."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from tests.server.conftest import MODEL_NAME

README = Path(__file__).resolve().parents[2] / "README.md"
CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"


def chat(**changes):
    body = {**CHAT, **changes}
    return {k: v for k, v in body.items() if v is not ...}


# (id, method, path, body: dict | bytes, headers, status, param)
BAD = [
    ("malformed-json", "POST", CHAT_URL, b'{"model": "x", ', None, 400, None),
    ("body-is-a-list", "POST", CHAT_URL, b"[1, 2]", None, 400, None),
    ("body-is-a-string", "POST", CHAT_URL, b'"hello"', None, 400, None),
    ("missing-messages", "POST", CHAT_URL, chat(messages=...), None, 400, "messages"),
    ("empty-messages", "POST", CHAT_URL, chat(messages=[]), None, 400, "messages"),
    (
        "bad-role",
        "POST",
        CHAT_URL,
        chat(messages=[{"role": "robot", "content": "x"}]),
        None,
        400,
        "messages[0].role",
    ),
    ("messages-not-a-list", "POST", CHAT_URL, chat(messages="hi"), None, 400, "messages"),
    (
        "image-content-part",
        "POST",
        CHAT_URL,
        chat(
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}},
                    ],
                }
            ]
        ),
        None,
        400,
        "messages[0]",
    ),
    ("temperature-3", "POST", CHAT_URL, chat(temperature=3), None, 400, "temperature"),
    ("temperature-string", "POST", CHAT_URL, chat(temperature="hot"), None, 400, "temperature"),
    ("top-p-1.5", "POST", CHAT_URL, chat(top_p=1.5), None, 400, "top_p"),
    ("max-tokens-0", "POST", CHAT_URL, chat(max_tokens=0), None, 400, "max_tokens"),
    ("max-tokens-string", "POST", CHAT_URL, chat(max_tokens="10"), None, 400, "max_tokens"),
    ("n-2", "POST", CHAT_URL, chat(n=2), None, 400, "n"),
    (
        "five-stop-strings",
        "POST",
        CHAT_URL,
        chat(stop=["a", "b", "c", "d", "e"]),
        None,
        400,
        "stop",
    ),
    ("stop-not-a-string", "POST", CHAT_URL, chat(stop=5), None, 400, "stop"),
    ("unknown-model", "POST", CHAT_URL, chat(model="gpt-17"), None, 404, "model"),
    ("unknown-field", "POST", CHAT_URL, chat(qfilter_budget=8), None, 400, "qfilter_budget"),
    ("budget-0", "POST", CHAT_URL, chat(qfilters_budget=0), None, 400, "qfilters_budget"),
    ("budget-string", "POST", CHAT_URL, chat(qfilters_budget="64"), None, 400, "qfilters_budget"),
    ("budget-float", "POST", CHAT_URL, chat(qfilters_budget=64.5), None, 400, "qfilters_budget"),
    ("recent-negative", "POST", CHAT_URL, chat(qfilters_recent=-1), None, 400, "qfilters_recent"),
    ("n-sink-bool", "POST", CHAT_URL, chat(qfilters_n_sink=True), None, 400, "qfilters_n_sink"),
    ("chunk-0", "POST", CHAT_URL, chat(qfilters_chunk=0), None, 400, "qfilters_chunk"),
    (
        "budget-mode-unknown",
        "POST",
        CHAT_URL,
        chat(qfilters_budget_mode="dynamic"),
        None,
        400,
        "qfilters_budget_mode",
    ),
    ("floor-0", "POST", CHAT_URL, chat(qfilters_floor=0), None, 400, "qfilters_floor"),
    ("floor-over-1", "POST", CHAT_URL, chat(qfilters_floor=1.5), None, 400, "qfilters_floor"),
    (
        "adaptive-with-knorm",
        "POST",
        CHAT_URL,
        chat(qfilters_budget_mode="adaptive", kv_method="knorm"),
        None,
        400,
        "qfilters_budget_mode",
    ),
    ("chunk-string", "POST", CHAT_URL, chat(qfilters_chunk="8"), None, 400, "qfilters_chunk"),
    (
        "threshold-without-kvzap",
        "POST",
        CHAT_URL,
        chat(kv_method="qfilters", kvzap_threshold=-5.0),
        None,
        400,
        "kvzap_threshold",
    ),
    (
        "threshold-string",
        "POST",
        CHAT_URL,
        chat(kvzap_threshold="low"),
        None,
        400,
        "kvzap_threshold",
    ),
    (
        "chunk-over-budget",
        "POST",
        CHAT_URL,
        chat(qfilters_budget=16, qfilters_chunk=16),
        None,
        400,
        "qfilters_chunk",
    ),
    (
        "sink-plus-recent-over-budget",
        "POST",
        CHAT_URL,
        chat(qfilters_budget=8, qfilters_recent=6, qfilters_n_sink=4),
        None,
        400,
        "qfilters_budget",
    ),
    ("unknown-kv-method", "POST", CHAT_URL, chat(kv_method="lru"), None, 400, "kv_method"),
    (
        "stream-options-without-stream",
        "POST",
        CHAT_URL,
        chat(stream_options={"include_usage": True}),
        None,
        400,
        "stream_options",
    ),
    (
        "top-logprobs-without-logprobs",
        "POST",
        CHAT_URL,
        chat(top_logprobs=2),
        None,
        400,
        "top_logprobs",
    ),
    (
        "prompt-plus-max-tokens-beyond-context",
        "POST",
        CHAT_URL,
        chat(max_tokens=2047),
        None,
        400,
        "max_tokens",
    ),
    (
        "beyond-context-streaming",
        "POST",
        CHAT_URL,
        chat(max_tokens=2047, stream=True),
        None,
        400,
        "max_tokens",
    ),
    (
        "body-over-limit",
        "POST",
        CHAT_URL,
        json.dumps(chat(messages=[{"role": "user", "content": "x" * 100_000}])).encode(),
        None,
        413,
        None,
    ),
    (
        "form-typed-body-that-is-not-json",
        "POST",
        CHAT_URL,
        b"model=qfserve-tiny&max_tokens=2",
        {"content-type": "application/x-www-form-urlencoded"},
        415,
        None,
    ),
    (
        "wrong-content-type",
        "POST",
        CHAT_URL,
        json.dumps(CHAT).encode(),
        {"content-type": "text/plain"},
        415,
        None,
    ),
    (
        "completions-missing-prompt",
        "POST",
        COMPLETIONS_URL,
        {"model": MODEL_NAME, "max_tokens": 4},
        None,
        400,
        "prompt",
    ),
    (
        "completions-logprobs-9",
        "POST",
        COMPLETIONS_URL,
        {"model": MODEL_NAME, "prompt": "x", "logprobs": 9},
        None,
        400,
        "logprobs",
    ),
    (
        "completions-token-out-of-vocab",
        "POST",
        COMPLETIONS_URL,
        {"model": MODEL_NAME, "prompt": [1, 10_000_000]},
        None,
        400,
        "prompt",
    ),
    (
        "completions-two-prompts",
        "POST",
        COMPLETIONS_URL,
        {"model": MODEL_NAME, "prompt": ["a", "b"]},
        None,
        400,
        "prompt",
    ),
    ("unknown-route", "GET", "/v1/engines", None, None, 404, None),
    ("wrong-method", "GET", CHAT_URL, None, None, 405, None),
    ("wrong-method-models", "POST", "/v1/models", b"{}", None, 405, None),
]


@pytest.mark.parametrize(
    ("method", "path", "body", "headers", "status", "param"),
    [case[1:] for case in BAD],
    ids=[case[0] for case in BAD],
)
def test_bad_request_gets_openai_error(server, method, path, body, headers, status, param):
    content = body if isinstance(body, bytes) else None
    resp = httpx.request(
        method,
        server.url + path,
        content=content,
        json=body if isinstance(body, dict) else None,
        headers=headers or ({"content-type": "application/json"} if content is not None else None),
    )
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["param"] == param
    if "image_url" in json.dumps(body if isinstance(body, dict) else {}):
        assert "'image_url' are not supported" in error["message"]


@pytest.mark.parametrize("media", ["application/x-www-form-urlencoded", None])
def test_a_json_body_sent_as_curl_sends_it_is_read_as_json(server, media):
    """``curl -d '{...}'`` without ``-H 'Content-Type: application/json'`` sends the form
    type; a body that is a JSON object is answered as if it had been typed."""
    resp = httpx.post(
        server.url + CHAT_URL,
        content=json.dumps(CHAT).encode(),
        headers={"content-type": media} if media else {},
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["object"] == "chat.completion"


def test_healthy_after_the_bad_inputs(server):
    assert len(BAD) >= 20
    assert httpx.get(f"{server.url}/health").status_code == 200
    resp = server.client().chat.completions.create(
        model=MODEL_NAME, messages=CHAT["messages"], max_tokens=2
    )
    assert resp.usage.completion_tokens <= 2


def test_sdk_raises_its_typed_errors(server):
    import openai

    client = server.client()
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=MODEL_NAME, messages=CHAT["messages"], extra_body={"qfilters_budget": -3}
        )
    assert exc.value.body["param"] == "qfilters_budget"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=CHAT["messages"])
