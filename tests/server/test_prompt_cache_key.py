"""``prompt_cache_key`` names the kept conversation: a request continues only caches kept
under its key (``usage.prompt_tokens_details.cached_tokens``, read by the official SDK), and
a key that is not a string of at most 256 characters is a 400 naming it."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import MODEL_NAME

PROMPT = "Named conversations keep their own caches: the pass key is 5150."


def cached(server, endpoint: str, key: str | None) -> int:
    """Send ``PROMPT`` under ``key``; how many of its tokens came from a kept cache."""
    client = server.client()
    extra = {} if key is None else {"prompt_cache_key": key}
    if endpoint == "chat":
        resp = client.chat.completions.create(
            model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}], max_tokens=4,
            temperature=0, extra_body=extra,
        )  # fmt: skip
    else:
        resp = client.completions.create(
            model=MODEL_NAME, prompt=PROMPT, max_tokens=4, temperature=0, extra_body=extra
        )
    return resp.usage.prompt_tokens_details.cached_tokens


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_a_key_continues_only_its_own_caches(server, endpoint):
    # The same prompt again: a kept full cache holding it and its answer is trimmed to it.
    first = f"{endpoint}-first"
    assert cached(server, endpoint, first) == 0
    assert cached(server, endpoint, f"{endpoint}-second") == 0  # same prefix, other key
    assert cached(server, endpoint, first) > 0
    assert cached(server, endpoint, f"{endpoint}-second") > 0


def test_a_later_turn_under_default_settings_continues_its_conversation(server):
    """Default settings (``--budget auto``: a full cache sized to each turn) still reuse."""
    client = server.client()
    messages = [{"role": "user", "content": "Remember the pass key 8086."}]
    for turn in range(3):
        resp = client.chat.completions.create(
            model=MODEL_NAME, messages=messages, max_tokens=4, temperature=0,
            extra_body={"prompt_cache_key": "default-settings"},
        )  # fmt: skip
        assert resp.model_extra["kv_cache"]["method"] == "full"
        assert (resp.usage.prompt_tokens_details.cached_tokens > 0) == (turn > 0)
        messages += [
            {"role": "assistant", "content": resp.choices[0].message.content},
            {"role": "user", "content": f"Turn {turn + 2}: the pass key again?"},
        ]


@pytest.mark.parametrize(
    "key", ["k" * 257, 42, ["a"], {"a": 1}], ids=["too-long", "int", "list", "object"]
)
def test_a_bad_key_is_a_400_naming_it(server, key):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2, "prompt_cache_key": key}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == "prompt_cache_key" and error["type"] == "invalid_request_error"


def test_a_key_of_256_characters_is_accepted(server):
    resp = server.client().chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
        extra_body={"prompt_cache_key": "k" * 256, "user": "someone"},
    )  # fmt: skip
    assert resp.choices[0].message.role == "assistant"
