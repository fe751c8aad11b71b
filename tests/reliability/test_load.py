"""Steady load (concurrent streaming OpenAI SDK clients, exact token counts, latency and
memory figures) and overload (a burst against a short queue: only 200s and fast 503s)."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai.types.chat import ChatCompletionChunk

from qfserve.engine.serving.config import DEFAULT_MAX_BATCH
from tests.reliability.harness import (
    Sampler,
    Server,
    percentiles,
    sse_events,
    start_server,
    stop_server,
)

WORDS = [
    "the",
    "cache",
    "keeps",
    "what",
    "the",
    "filter",
    "ranks",
    "highest",
    "and",
    "forgets",
    "the",
    "rest",
]
PROMPT_WORDS = (2, 12, 60, 240)  # ~5 to ~1,200 prompt tokens
BUDGETS = (16, 64, 256)
METHODS = ("qfilters", "knorm", "streaming", "full")


def prompt_of(n_words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def prompt_counter(model: Path):
    """The prompt's token count, from the tokenizer and chat template (not the server)."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(model)
    lock = threading.Lock()

    def count(messages: list[dict[str, str]]) -> int:
        with lock:
            return len(tok.apply_chat_template(messages, add_generation_prompt=True))

    return count


def stream_one(server: Server, client, spec: dict[str, Any]) -> dict[str, Any]:
    """One streaming chat through the SDK's raw stream; checks its own invariants."""
    t0 = time.perf_counter()
    stamps, finishes, usage, events = [], [], None, []
    with client.chat.completions.with_streaming_response.create(
        model=server.model.name,
        messages=spec["messages"],
        max_tokens=spec["max_tokens"],
        temperature=0,
        logit_bias=server.no_bias,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=spec["extra_body"],
    ) as resp:
        for data in sse_events(resp.iter_lines()):
            events.append(data)
            if data == "[DONE]":
                break
            payload = json.loads(data)
            assert "error" not in payload, payload
            chunk = ChatCompletionChunk.model_validate(payload)
            if chunk.usage is not None and not chunk.choices:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    stamps.append(time.perf_counter())
                if choice.finish_reason is not None:
                    finishes.append(choice.finish_reason)
    end = time.perf_counter()
    problems = []
    if not events or events[-1] != "[DONE]":
        problems.append("no [DONE]")
    if finishes != ["length"]:
        problems.append(f"finish reasons {finishes}")
    if usage is None or usage.completion_tokens != spec["max_tokens"]:
        problems.append(f"completion tokens {usage and usage.completion_tokens}")
    if usage is None or usage.prompt_tokens != spec["prompt_tokens"]:
        problems.append(f"prompt tokens {usage and usage.prompt_tokens} != {spec['prompt_tokens']}")
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {
        "problems": problems,
        "ttft": (stamps[0] - t0) if stamps else None,
        "gaps": gaps,
        "e2e": end - t0,
        "tokens": usage.completion_tokens if usage else 0,
    }


def make_specs(n: int, size, count) -> list[dict[str, Any]]:
    rng = random.Random(8)
    specs = []
    for i in range(n):
        messages = [{"role": "user", "content": prompt_of(rng.choice(PROMPT_WORDS), rng)}]
        method = METHODS[i % len(METHODS)]
        extra = {"kv_method": method, "qfilters_budget": rng.choice(BUDGETS)}
        if rng.random() < 0.3:
            extra["qfilters_recent"] = 4
        specs.append(
            {
                "messages": messages,
                "max_tokens": rng.randint(*size.steady_max_tokens),
                "extra_body": extra,
                "prompt_tokens": count(messages),
            }
        )
    return specs


def test_steady_load(server, size, report):
    specs = make_specs(size.steady_requests, size, prompt_counter(server.model))
    client = server.openai()
    server.wait_idle(30)
    before = server.state()
    t0 = time.perf_counter()
    with Sampler(server) as sampler, ThreadPoolExecutor(size.steady_clients) as pool:
        results = list(pool.map(lambda s: _guard(stream_one, server, client, s), specs))
    wall = time.perf_counter() - t0
    settle = server.wait_idle(10)
    after = server.state()
    errors = [r["problems"] for r in results if r["problems"]]
    tokens = sum(r["tokens"] for r in results)
    figures = {
        "requests": len(specs),
        "clients": size.steady_clients,
        "errors": len(errors),
        "ttft": percentiles([r["ttft"] for r in results if r["ttft"] is not None]),
        "inter_token": percentiles([g for r in results for g in r["gaps"]]),
        "end_to_end": percentiles([r["e2e"] for r in results]),
        "completion_tokens": tokens,
        "tokens_per_s": round(tokens / wall, 1),
        "wall_s": round(wall, 2),
        "rss_bytes": _bpa(before, sampler.peak, after, "rss_bytes"),
        "mlx_active_bytes": _bpa(before, sampler.peak, after, "mlx_active_bytes"),
        "mlx_peak_bytes_after": after["mlx_peak_bytes"],
        "kv_bytes": {
            "before": before["kv_bytes"],
            "peak": sampler.peak.get("kv_bytes"),
            "after": after["kv_bytes"],
        },
    }
    # QFSERVE_MAX_BATCH=N in the environment starts the server with another batch size;
    # its figures are kept beside the default's under their own name.
    max_batch = server.admin()["totals"]["max_batch"]
    figures["max_batch"] = max_batch
    report.add(
        "steady_load" if max_batch == DEFAULT_MAX_BATCH else f"steady_load_max_batch_{max_batch}",
        figures,
    )
    assert not errors, errors[:5]
    assert settle is not None and after["kv_bytes"] == before["kv_bytes"] == 0


def _guard(fn, *args) -> dict[str, Any]:
    """Turn an exception in a client into a recorded problem (the pool must not stop)."""
    try:
        return fn(*args)
    except Exception as exc:  # noqa: BLE001 - every failure is a finding to report
        return {
            "problems": [f"{type(exc).__name__}: {exc}"],
            "ttft": None,
            "gaps": [],
            "e2e": 0.0,
            "tokens": 0,
        }


def _bpa(before: dict, peak: dict, after: dict, key: str) -> dict[str, int | None]:
    return {"before": before[key], "peak": peak.get(key), "after": after[key]}


# -- overload --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tight(model, size, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "tight.log"
    srv = start_server(model, log, "--max-queue", str(size.overload_queue))
    yield srv
    stop_server(srv)


def burst_one(
    server: Server, http: httpx.Client, i: int, barrier: threading.Barrier
) -> dict[str, Any]:
    body = {
        "model": server.model.name,
        "messages": [{"role": "user", "content": f"request {i}"}],
        "max_tokens": 8,
        "temperature": 0,
        "logit_bias": server.no_bias,
        "stream": i % 2 == 0,
    }
    barrier.wait(30)
    t0 = time.perf_counter()
    try:
        with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            head = time.perf_counter() - t0
            text = "".join(resp.iter_text())
        return {
            "status": resp.status_code,
            "headers": dict(resp.headers),
            "text": text,
            "head_s": head,
            "total_s": time.perf_counter() - t0,
            "stream": body["stream"],
        }
    except httpx.HTTPError as exc:
        return {
            "status": None,
            "error": f"{type(exc).__name__}: {exc}",
            "total_s": time.perf_counter() - t0,
        }


def check_burst(result: dict[str, Any]) -> str | None:
    """What is wrong with one overload answer, or ``None``."""
    status = result["status"]
    if status == 503:
        body = json.loads(result["text"])
        retry = result["headers"].get("retry-after", "")
        if "error" not in body or not retry.isdigit() or int(retry) < 1:
            return f"503 without JSON error or Retry-After: {result}"
        return None
    if status != 200:
        return f"status {status}: {result.get('error') or result.get('text', '')[:200]}"
    if result["stream"]:
        events = [line[6:] for line in result["text"].split("\n") if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]" or any('"error"' in e for e in events):
            return f"stream did not end cleanly: {events[-2:]}"
    elif json.loads(result["text"])["usage"]["completion_tokens"] != 8:
        return f"wrong token count: {result['text'][:200]}"
    return None


def test_overload_only_200_or_fast_503(tight, size, report):
    barrier = threading.Barrier(size.overload_clients)
    # One client for all: building an httpx client per request costs more than the request.
    limits = httpx.Limits(max_connections=size.overload_clients)
    http = httpx.Client(base_url=tight.url, timeout=120, limits=limits)
    with http, ThreadPoolExecutor(size.overload_clients) as pool:
        results = list(
            pool.map(lambda i: burst_one(tight, http, i, barrier), range(size.overload_clients))
        )
    problems = [p for p in map(check_burst, results) if p]
    rejected = [r["total_s"] for r in results if r["status"] == 503]
    served = [r["total_s"] for r in results if r["status"] == 200]
    settle = tight.wait_idle(10)
    report.add(
        "overload",
        {
            "clients": size.overload_clients,
            "queue": size.overload_queue,
            "ok_200": len(served),
            "rejected_503": len(rejected),
            "other": len(results) - len(served) - len(rejected),
            "rejection_latency": percentiles(rejected),
            "served_latency": percentiles(served),
            "idle_after_s": settle,
        },
    )
    assert not problems, problems[:5]
    assert served and rejected
    # A rejection never waits for the model; the bound leaves room for 128 client threads
    # starting at once on a small machine.
    assert max(rejected) < 2.0
    assert settle is not None
