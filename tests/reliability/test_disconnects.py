"""Disconnect storm: clients that leave before the headers, during prefill, after a few
chunks, or time out on a non-streaming request. Afterwards nothing may be left behind."""

from __future__ import annotations

import json
import random
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from tests.reliability.harness import HOST, Server, http_request, sse_events

MODES = ("before_headers", "prefill", "after_chunks", "client_timeout")
LONG_PROMPT = "remember this key value pair and keep it " * 150  # ~1,200 tokens


def body(server: Server, rng: random.Random, *, stream: bool, long: bool = False) -> dict:
    return {
        "model": server.model.name,
        "messages": [{"role": "user", "content": LONG_PROMPT if long else "tell a story"}],
        "max_tokens": rng.randint(32, 256),
        "temperature": 0,
        "logit_bias": server.no_bias,
        "stream": stream,
        "qfilters_budget": rng.choice((16, 64, 256)),
    }


def drop(server: Server, mode: str, seed: int) -> str:
    """One client that goes away; returns what it saw last (for the report)."""
    rng = random.Random(seed)
    if mode in ("before_headers", "prefill"):
        payload = json.dumps(body(server, rng, stream=True, long=mode == "prefill")).encode()
        with socket.create_connection((HOST, server.port), timeout=10) as sock:
            sock.sendall(http_request("/v1/chat/completions", payload, port=server.port))
            time.sleep(rng.uniform(0.0, 0.02 if mode == "before_headers" else 0.3))
            # SO_LINGER 0: the close is a reset, the rudest way to leave.
            if rng.random() < 0.5:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\0\0\0\0\0\0\0")
        return mode
    if mode == "after_chunks":
        k = rng.randint(1, 6)
        with httpx.stream(
            "POST",
            f"{server.url}/v1/chat/completions",
            json=body(server, rng, stream=True),
            timeout=60,
        ) as resp:
            seen = 0
            for _ in sse_events(resp.iter_lines()):
                seen += 1
                if seen >= k:
                    break
        return f"{mode}:{seen}"
    try:
        httpx.post(
            f"{server.url}/v1/chat/completions",
            json=body(server, rng, stream=False),
            timeout=rng.uniform(0.05, 0.5),
        )
        return f"{mode}:answered"
    except httpx.TimeoutException:
        return f"{mode}:timed_out"


def fresh_request_completes(server: Server) -> bool:
    with httpx.stream(
        "POST",
        f"{server.url}/v1/chat/completions",
        json={
            "model": server.model.name,
            "messages": [{"role": "user", "content": "still there?"}],
            "max_tokens": 8,
            "logit_bias": server.no_bias,
            "stream": True,
        },
        timeout=60,
    ) as resp:
        events = list(sse_events(resp.iter_lines()))
    return (
        resp.status_code == 200
        and events[-1] == "[DONE]"
        and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
    )


def storm(server: Server, n: int, concurrency: int, seed: int) -> list[str]:
    plan = [(MODES[i % len(MODES)], seed * 100_000 + i) for i in range(n)]
    random.Random(seed).shuffle(plan)
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda p: _safe_drop(server, *p), plan))


def _safe_drop(server: Server, mode: str, seed: int) -> str:
    try:
        return drop(server, mode, seed)
    except (OSError, httpx.HTTPError) as exc:
        return f"{mode}:client_error:{type(exc).__name__}"


def test_disconnect_storm_leaves_nothing_behind(server, size, report):
    # Warm up every path once, then take the baseline at idle.
    storm(server, 2 * len(MODES), len(MODES), seed=1)
    assert server.wait_idle(30) is not None
    time.sleep(1.0)
    baseline = server.state()
    t0 = time.perf_counter()
    outcomes = storm(server, size.storm_requests, size.storm_concurrency, seed=2)
    last = time.perf_counter()
    settle = server.wait_idle(10)
    settled = server.state()
    time.sleep(2.0)  # idle, then compare memory with the baseline
    idle = server.state()
    # A leak grows with every storm. A one-off does not: glibc gives a thread that first
    # allocates under contention its own arena (up to 64 MiB, kept for the process's life),
    # and the allocator settles on its sizes over a storm or two (the batch's shared arrays
    # differ in size from step to step); which storms that takes is chance (three storms in a
    # row grew 3-5% each in one run of many). So the same storm runs twice more, and twice
    # more again while no step has grown by at most 2% of the baseline; a leak never stops.
    rss, cached = [idle["rss_bytes"]], [idle["mlx_cache_bytes"]]
    steps = [rss[0] - baseline["rss_bytes"]]
    for seed in (3, 4, 5, 6):
        if min(steps) <= 0.02 * baseline["rss_bytes"] and len(steps) >= 3:
            break
        storm(server, size.storm_requests, size.storm_concurrency, seed=seed)
        assert server.wait_idle(10) is not None
        time.sleep(2.0)
        again = server.state()
        steps.append(again["rss_bytes"] - rss[-1])
        rss.append(again["rss_bytes"])
        cached.append(again["mlx_cache_bytes"])
    fresh = fresh_request_completes(server)
    snap = server.admin()["totals"]
    figures: dict[str, Any] = {
        "requests": len(outcomes),
        "wall_s": round(last - t0, 2),
        "outcomes": {m: sum(o.startswith(m) for o in outcomes) for m in MODES},
        "client_errors": sum("client_error" in o for o in outcomes),
        "idle_after_last_s": None if settle is None else round(settle, 3),
        "after": {k: settled[k] for k in ("active", "queued", "kv_bytes")},
        "rss_bytes": {
            "baseline": baseline["rss_bytes"],
            "after_storm": idle["rss_bytes"],
            "after_last_storm": again["rss_bytes"],
        },
        "rss_growth_pct_per_storm": [round(100 * d / baseline["rss_bytes"], 2) for d in steps],
        "mlx_active_bytes": {
            "baseline": baseline["mlx_active_bytes"],
            "after_idle": idle["mlx_active_bytes"],
            "after_last_storm": again["mlx_active_bytes"],
        },
        # Freed buffers MLX keeps for reuse count in RSS: a step that grows with them is the
        # allocator's cache, not a leak (reported so that a failure says which it was).
        "mlx_cache_growth_pct_per_storm": [
            round(100 * (b - a) / baseline["rss_bytes"], 2)
            for a, b in zip([baseline["mlx_cache_bytes"], *cached], cached, strict=False)
        ],
        "server_totals": {k: snap[k] for k in ("requests", "done", "cancelled", "error")},
        "fresh_request_ok": fresh,
    }
    report.add("disconnect_storm", figures)
    assert settle is not None and settle <= 1.0, figures
    assert settled["kv_bytes"] == baseline["kv_bytes"] == 0
    assert min(steps) <= 0.02 * baseline["rss_bytes"], figures
    # MLX counts exact bytes. A request leaves at least its KV rows behind if it leaks (over
    # 1 KiB per token on this model), and a leak grows with every storm; a lazily created
    # constant of a few bytes appears once.
    assert idle["mlx_active_bytes"] <= baseline["mlx_active_bytes"] + 1024, figures
    assert again["mlx_active_bytes"] <= idle["mlx_active_bytes"], figures
    assert fresh
