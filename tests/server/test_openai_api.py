"""The OpenAI endpoints through the official SDK (strict response validation) and raw HTTP."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.server.conftest import MODEL_NAME

CHAT = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog."}]
# Longer than the key-SVD fallback's 128 calibration keys, so eviction really runs.
NO_EOS = {"1": -100}  # the tiny tokenizer's <|end|>: keeps long generations running
LONG_PROMPT = "Pack my box with five dozen liquor jugs. 0123456789 " * 30


def sse_events(response: httpx.Response) -> list[str]:
    """The ``data:`` payloads of a raw SSE response, asserting LF framing."""
    raw = response.read().decode()
    assert "\r" not in raw
    frames = [f for f in raw.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames), frames[:3]
    return [f[len("data: ") :] for f in frames]


def test_models_lists_the_model_with_its_context(server):
    models = server.client().models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert models.data[0].model_extra["context_length"] == 2048


def test_chat_completion(server):
    resp = server.client().chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=8, temperature=0
    )
    choice = resp.choices[0]
    assert resp.object == "chat.completion"
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason in ("length", "stop")
    assert resp.usage.completion_tokens <= 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens
    kv = resp.model_extra["kv_cache"]
    # --budget auto: a request that fits the server's memory keeps every row, and says why.
    assert kv["method"] == "full" and kv["budget_source"] == "auto"
    assert kv["budget"] == resp.usage.prompt_tokens + 8 and kv["evictions"] == 0


def test_chat_stream_role_first_one_finish_reason_and_usage(server):
    stream = server.client().chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=12,
        stream=True,
        stream_options={"include_usage": True},
        logit_bias=NO_EOS,  # sampled at temperature 1: without it an early EOS may end it
        extra_body={"kv_method": "knorm", "qfilters_budget": 64},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert len(finishes) == 1
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage.completion_tokens == 12
    finish_chunk = next(c for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finish_chunk.model_extra["kv_cache"]["method"] == "knorm"


def test_chat_stream_raw_framing_ends_with_done(server):
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    payloads = [json.loads(e) for e in events[:-1]]
    assert sum(p["choices"][0]["finish_reason"] is not None for p in payloads) == 1
    assert "kv_cache" in payloads[-1]


def test_completions_text_and_token_prompt(server):
    client = server.client()
    resp = client.completions.create(
        model=MODEL_NAME, prompt="def f(x):", max_tokens=6, temperature=0, logprobs=2
    )
    assert resp.object == "text_completion" and resp.usage.completion_tokens == 6
    assert len(resp.choices[0].logprobs.token_logprobs) == 6
    # A dict per token: ids decoding to the same text (byte fragments) share a key.
    assert all(1 <= len(top) <= 2 for top in resp.choices[0].logprobs.top_logprobs)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=[5, 6, 7, 8], max_tokens=3)
    assert by_ids.usage.prompt_tokens == 4
    # The SDK types a legacy completion chunk's finish_reason as non-null, but OpenAI (and
    # we) send null until the last chunk: strict validation cannot parse any such stream.
    lenient = server.client(_strict_response_validation=False)
    chunks = list(
        lenient.completions.create(
            model=MODEL_NAME, prompt="def f(x):", max_tokens=6, temperature=0, stream=True
        )
    )
    assert sum(c.choices[0].finish_reason is not None for c in chunks) == 1
    assert "".join(c.choices[0].text for c in chunks) == resp.choices[0].text


def test_budget_from_extra_body_is_honoured_and_shown_by_admin(server):
    budget = 32
    resp = server.client().chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": LONG_PROMPT}],
        max_tokens=8,
        extra_body={"qfilters_budget": budget, "qfilters_n_sink": 2, "qfilters_recent": 4},
    )
    assert resp.usage.prompt_tokens > 2 * budget
    admin = httpx.get(f"{server.url}/admin/cache").json()
    record = next(r for r in admin["history"] if r["id"] == resp.id)
    assert (record["budget"], record["n_sink"], record["recent"]) == (budget, 2, 4)
    assert record["state"] == "done"
    assert record["tokens_seen"] >= resp.usage.prompt_tokens
    assert 0 < record["tokens_kept"] <= budget
    assert record["evictions"] > 0 and record["compression_ratio"] > 1
    assert resp.model_extra["kv_cache"]["tokens_kept"] == record["tokens_kept"]
    assert "content" not in json.dumps(admin) and LONG_PROMPT[:20] not in json.dumps(admin)


def test_chunk_from_extra_body_is_honoured_echoed_and_shown_by_admin(server):
    client = server.client()
    kwargs = dict(model=MODEL_NAME, messages=[{"role": "user", "content": LONG_PROMPT}],
                  max_tokens=8, temperature=0)  # fmt: skip
    resp = client.chat.completions.create(
        **kwargs, extra_body={"qfilters_budget": 32, "qfilters_chunk": 8}
    )
    kv = resp.model_extra["kv_cache"]
    assert kv["chunk"] == 8 and kv["budget"] == 32 and kv["evictions"] > 0
    record = next(
        r for r in httpx.get(f"{server.url}/admin/cache").json()["history"] if r["id"] == resp.id
    )
    assert record["chunk"] == 8 and 0 < record["tokens_kept"] <= 32
    plain = client.chat.completions.create(**kwargs, extra_body={"qfilters_budget": 32})
    assert plain.model_extra["kv_cache"]["chunk"] == 1


def test_temperature_zero_stream_equals_non_stream(server):
    client = server.client()
    kwargs = dict(model=MODEL_NAME, messages=CHAT, max_tokens=40, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(**kwargs, stream=True)
        if c.choices
    )
    assert streamed == whole and whole


def test_seed_makes_sampling_repeatable(server):
    client = server.client()
    kwargs = dict(model=MODEL_NAME, messages=CHAT, max_tokens=16, temperature=1.0, seed=7)
    first = client.chat.completions.create(**kwargs).choices[0].message.content
    assert client.chat.completions.create(**kwargs).choices[0].message.content == first


def test_stop_string_ends_generation_and_is_never_emitted(server):
    client = server.client()
    kwargs = dict(model=MODEL_NAME, prompt="The quick brown", max_tokens=40, temperature=0)
    text = client.completions.create(**kwargs).choices[0].text
    stop = next(text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip())
    expected = text[: text.index(stop)]
    resp = client.completions.create(**kwargs, stop=[stop, "never-matches"])
    assert resp.choices[0].text == expected and resp.choices[0].finish_reason == "stop"
    lenient = server.client(_strict_response_validation=False)  # see the completions test
    streamed = "".join(
        c.choices[0].text for c in lenient.completions.create(**kwargs, stop=stop, stream=True)
    )
    assert streamed == expected


def test_chat_logprobs(server):
    resp = server.client().chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=5,
        logprobs=True,
        top_logprobs=3,
        logit_bias=NO_EOS,  # a sampled end of text would stop it short of 5 tokens
    )
    content = resp.choices[0].logprobs.content
    assert len(content) == 5 and all(len(t.top_logprobs) == 3 for t in content)
    assert all(t.logprob <= 0 for t in content)


def _active(server) -> list[dict]:
    return httpx.get(f"{server.url}/admin/cache").json()["active"]


def _wait_idle(server, within: float) -> float:
    start = time.monotonic()
    while _active(server):
        assert time.monotonic() - start < within, _active(server)
        time.sleep(0.02)
    return time.monotonic() - start


def test_closing_a_stream_cancels_generation(server):
    body = {
        "model": MODEL_NAME,
        "messages": CHAT,
        "max_tokens": 1900,
        "stream": True,
        "logit_bias": NO_EOS,
    }
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as resp:
        lines = resp.iter_lines()
        seen = [line for line, _ in zip(lines, range(6), strict=False) if line]
        assert seen
    _wait_idle(server, within=1.0)
    last = httpx.get(f"{server.url}/admin/cache").json()["history"][0]
    assert last["state"] == "cancelled" and last["completion_tokens"] < 1900
    resp = server.client().chat.completions.create(model=MODEL_NAME, messages=CHAT, max_tokens=4)
    assert resp.choices[0].finish_reason in ("length", "stop")


def test_a_non_stream_client_that_leaves_cancels_generation(server):
    body = {"model": MODEL_NAME, "messages": CHAT, "max_tokens": 1900, "logit_bias": NO_EOS}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=0.5)
    _wait_idle(server, within=1.0)
    assert httpx.get(f"{server.url}/admin/cache").json()["history"][0]["state"] == "cancelled"


def test_metrics_exposes_prometheus_counters(server):
    text = httpx.get(f"{server.url}/metrics").text
    for name in (
        "qfserve_requests_total",
        "qfserve_prompt_tokens_total",
        "qfserve_completion_tokens_total",
        "qfserve_time_to_first_token_seconds_bucket",
        "qfserve_request_latency_seconds_bucket",
        "qfserve_active_requests",
        "qfserve_queue_length",
        "qfserve_kv_kept_bytes_total",
        "qfserve_kv_full_bytes_total",
    ):
        assert name in text
    assert 'outcome="ok"' in text


def _responses(server, status: str) -> float:
    for line in httpx.get(f"{server.url}/metrics").text.splitlines():
        if line.startswith(f'qfserve_http_responses_total{{status="{status}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_metrics_count_every_rejection_by_status(server):
    before = {s: _responses(server, s) for s in ("400", "404", "413", "415")}
    url = f"{server.url}/v1/chat/completions"
    assert httpx.post(url, json={"model": MODEL_NAME}).status_code == 400  # no messages
    assert httpx.post(url, json={"model": MODEL_NAME, "messages": "hi"}).status_code == 400
    assert httpx.get(f"{server.url}/v1/nothing").status_code == 404
    big = b"{" + b" " * (9 * 1024 * 1024) + b"}"
    assert (
        httpx.post(url, content=big, headers={"content-type": "application/json"}).status_code
        == 413
    )
    assert httpx.post(url, content=b"x", headers={"content-type": "text/plain"}).status_code == 415
    after = {s: _responses(server, s) for s in before}
    assert {s: after[s] - before[s] for s in before} == {"400": 2, "404": 1, "413": 1, "415": 1}


def test_sdk_parse_on_the_tiny_model(server):
    from pydantic import BaseModel, Field

    class Item(BaseModel):
        label: str = Field(max_length=8)
        size: int = Field(ge=0, le=99)

    completion = server.client().chat.completions.parse(
        model=MODEL_NAME,
        messages=CHAT,
        response_format=Item,
        temperature=0,
        max_tokens=64,
        extra_body={"qfilters_budget": 16},
    )
    item = completion.choices[0].message.parsed
    assert isinstance(item, Item) and len(item.label) <= 8


def test_sdk_retrieves_the_model_and_404s_another(server):
    import openai

    client = server.client()
    model = client.models.retrieve(MODEL_NAME)
    assert model.id == MODEL_NAME and model.object == "model"
    assert model.model_extra["context_length"] == 2048
    with pytest.raises(openai.NotFoundError) as exc:
        client.models.retrieve("org/other-model")
    assert exc.value.body["code"] == "model_not_found"


def test_admin_reports_the_weights_as_held_and_the_resident_memory(server, tiny_model_dir):
    """``weights_bytes`` is the served folder's tensors (the tiny model is float32: nothing
    dequantized, nothing added); ``resident_bytes`` is the process's RSS as the OS reports it."""
    import psutil
    from safetensors.numpy import load_file

    totals = httpx.get(f"{server.url}/admin/cache").json()["totals"]
    stored = sum(
        v.nbytes
        for f in sorted(tiny_model_dir.glob("*.safetensors"))
        for v in load_file(f).values()
    )
    assert totals["weights_bytes"] == stored
    rss = psutil.Process(server.pid).memory_info().rss
    assert abs(totals["resident_bytes"] - rss) < 0.1 * rss
    gauges = dict(
        line.rsplit(" ", 1)
        for line in httpx.get(f"{server.url}/metrics").text.splitlines()
        if line and not line.startswith("#")
    )
    assert float(gauges["qfserve_weights_bytes"]) == stored
    assert float(gauges["qfserve_resident_bytes"]) > stored
