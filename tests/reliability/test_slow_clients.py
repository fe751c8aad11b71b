"""Slow clients: a slowloris of half-sent requests, and a stream reader that stops reading.
Normal requests keep their latency; the stuck stream is aborted and its cache freed."""

from __future__ import annotations

import contextlib
import json
import socket
import statistics
import threading
import time

import httpx

from tests.reliability.harness import HOST, Server, http_request, percentiles


def normal_latencies(server: Server, n: int = 6) -> list[float]:
    body = {
        "model": server.model.name,
        "messages": [{"role": "user", "content": "a normal request"}],
        "max_tokens": 8,
        "temperature": 0,
        "logit_bias": server.no_bias,
    }
    out = []
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for _ in range(n):
            t0 = time.perf_counter()
            resp = http.post("/v1/chat/completions", json=body)
            assert resp.status_code == 200, resp.text
            out.append(time.perf_counter() - t0)
    return out


def keeps_latency(latencies: list[float], baseline: list[float]) -> bool:
    # Medians, with slack for a shared two-core machine.
    return statistics.median(latencies) <= 2 * statistics.median(baseline) + 0.25


def slowloris(server: Server, n: int, seconds: float, stop: threading.Event) -> list[socket.socket]:
    """``n`` sockets that send a request line and then one header byte a second."""
    socks = []
    for _ in range(n):
        sock = socket.create_connection((HOST, server.port), timeout=5)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        socks.append(sock)

    def drip() -> None:
        t0 = time.monotonic()
        while not stop.is_set() and time.monotonic() - t0 < seconds:
            for sock in socks:
                with contextlib.suppress(OSError):
                    sock.sendall(b"X")
            stop.wait(1.0)

    threading.Thread(target=drip, daemon=True).start()
    return socks


def test_slowloris_does_not_slow_normal_requests(server, size, report):
    baseline = normal_latencies(server)
    stop = threading.Event()
    socks = slowloris(server, size.slowloris_sockets, seconds=60, stop=stop)
    try:
        time.sleep(1.0)
        during = normal_latencies(server)
        alive = sum(_still_open(s) for s in socks)
    finally:
        stop.set()
        for sock in socks:
            sock.close()
    report.add(
        "slowloris",
        {
            "sockets": size.slowloris_sockets,
            "baseline": percentiles(baseline),
            "during": percentiles(during),
            "slowloris_sockets_still_open": alive,
        },
    )
    assert keeps_latency(during, baseline), (baseline, during)


def _still_open(sock: socket.socket) -> bool:
    sock.setblocking(False)
    try:
        return sock.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def test_a_stuck_stream_is_aborted_and_its_cache_freed(server, size, report):
    baseline = normal_latencies(server)
    body = {
        "model": server.model.name,
        "messages": [{"role": "user", "content": "stream a lot"}],
        "max_tokens": 1800,
        "temperature": 0,
        "logit_bias": server.no_bias,
        "logprobs": True,
        "top_logprobs": 20,  # ~3 KB per chunk: the socket buffers fill in seconds
        "stream": True,
    }
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: small window
    sock.settimeout(30)
    sock.connect((HOST, server.port))
    try:
        sock.sendall(
            http_request("/v1/chat/completions", json.dumps(body).encode(), port=server.port)
        )
        head = b""
        while b"data: {" not in head:  # headers and the first chunk, then stop reading
            head += sock.recv(4096)
        request_id = json.loads(head.split(b"data: ", 1)[1].split(b"\n", 1)[0])["id"]
        stalled_at = time.monotonic()
        state, aborted_after = _wait_finished(server, request_id, size.stall_s)
        freed = server.wait_idle(5)
        during = normal_latencies(server)  # still stalled: the server must not care
        time.sleep(max(0.0, size.stall_s - (time.monotonic() - stalled_at)))
    finally:
        sock.close()
    report.add(
        "stuck_stream",
        {
            "stall_s": size.stall_s,
            "write_timeout_s": size.write_timeout,
            "final_state": state,
            "aborted_after_s": aborted_after,
            "kv_freed": freed is not None,
            "baseline": percentiles(baseline),
            "while_stalled": percentiles(during),
        },
    )
    assert state == "cancelled" and aborted_after is not None and aborted_after < size.stall_s
    assert freed is not None
    assert keeps_latency(during, baseline), (baseline, during)


def _wait_finished(
    server: Server, request_id: str, limit: float
) -> tuple[str | None, float | None]:
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        snap = server.admin()
        done = [r for r in snap["history"] if r["id"] == request_id]
        if done:
            return done[0]["state"], round(time.monotonic() - t0, 2)
        time.sleep(0.1)
    return None, None
