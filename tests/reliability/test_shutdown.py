"""Shutdown: SIGTERM with streams in flight. New requests get 503 JSON while the server
drains; every stream finishes or ends with an error event and [DONE] at the deadline (or, if
it never started, a 503); the process exits 0 and leaves no process behind."""

from __future__ import annotations

import json
import signal
import threading
import time
from typing import Any

import httpx
import psutil

from tests.reliability.harness import Server, sse_events, start_server


def stream(server: Server, i: int, out: dict[int, dict[str, Any]]) -> None:
    body = {
        "model": server.model.name,
        "messages": [{"role": "user", "content": f"stream {i}"}],
        "max_tokens": 40,
        "temperature": 0,
        "logit_bias": server.no_bias,
        "stream": True,
    }
    try:
        with httpx.stream(
            "POST", f"{server.url}/v1/chat/completions", json=body, timeout=120
        ) as resp:
            if resp.status_code != 200:
                out[i] = {
                    "status": resp.status_code,
                    "headers": dict(resp.headers),
                    "body": resp.read().decode(),
                }
                return
            events = list(sse_events(resp.iter_lines()))
        out[i] = {"status": 200, "events": events}
    except httpx.HTTPError as exc:
        out[i] = {"status": None, "error": f"{type(exc).__name__}: {exc}"}


def outcome(result: dict[str, Any]) -> str:
    """finished / aborted (error event + [DONE]) / refused (503 JSON) / broken."""
    if result["status"] == 503:
        ok = "error" in json.loads(result["body"]) and result["headers"].get("retry-after")
        return "refused" if ok else "broken"
    if result["status"] != 200 or not result["events"] or result["events"][-1] != "[DONE]":
        return "broken"
    last = json.loads(result["events"][-2])
    if "error" in last:
        return "aborted"
    return "finished" if last["choices"][0]["finish_reason"] == "length" else "broken"


def test_sigterm_drains_then_exits_0(model, size, report, tmp_path):
    server = start_server(
        model, tmp_path / "shutdown.log", "--drain-timeout", str(size.drain_timeout),
        "--max-queue", str(2 * size.shutdown_streams),
    )  # fmt: skip
    process = psutil.Process(server.pid)
    results: dict[int, dict[str, Any]] = {}
    threads = [
        threading.Thread(target=stream, args=(server, i, results), daemon=True)
        for i in range(size.shutdown_streams)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while server.admin()["totals"]["active"] < size.shutdown_streams:
        assert time.monotonic() < deadline, "streams never all in flight"
        time.sleep(0.05)
    family = [process, *process.children(recursive=True)]
    t_signal = time.monotonic()
    server.process.send_signal(signal.SIGTERM)
    time.sleep(0.2)
    late = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"model": server.model.name, "messages": [{"role": "user", "content": "late"}]},
        timeout=10,
    )
    health = httpx.get(f"{server.url}/health", timeout=10)
    code = server.process.wait(size.drain_timeout + 30)
    exit_s = time.monotonic() - t_signal
    for t in threads:
        t.join(30)
    outcomes = [outcome(results.get(i, {"status": None})) for i in range(len(threads))]
    leftovers = [p.pid for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    figures = {
        "streams": len(threads),
        "drain_timeout_s": size.drain_timeout,
        "outcomes": {k: outcomes.count(k) for k in ("finished", "aborted", "refused", "broken")},
        "late_request": late.status_code,
        "health_while_draining": health.status_code,
        "exit_code": code,
        "exit_after_s": round(exit_s, 2),
        "leftover_processes": len(leftovers),
    }
    report.add("shutdown", figures)
    assert late.status_code == 503 and late.json()["error"] and late.headers["retry-after"]
    assert health.status_code == 503
    assert "broken" not in outcomes, [
        results.get(i) for i, o in enumerate(outcomes) if o == "broken"
    ]
    assert code == 0, server.logs()[-3000:]
    assert exit_s < size.drain_timeout + 10
    assert not leftovers
