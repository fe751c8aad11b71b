"""A second server with keys, a one-slot queue and a short drain: auth, 503s, SIGTERM."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.server.conftest import MODEL_NAME, Server, start_server, stop_server

API_KEY, ADMIN_KEY = "sk-test-123", "admin-456"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "hello"}]
LONG = {
    "model": MODEL_NAME,
    "messages": CHAT,
    "max_tokens": 1500,
    "stream": True,
    "logit_bias": {"1": -100},
}


@pytest.fixture(scope="module")
def locked(tiny_model_dir, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "locked.log"
    srv = start_server(
        tiny_model_dir,
        log,
        "--api-key",
        API_KEY,
        "--admin-key",
        ADMIN_KEY,
        "--max-queue",
        "1",
        "--max-batch",  # one running, one waiting: the queue is full
        "1",
        "--drain-timeout",
        "20",
    )
    yield srv
    stop_server(srv)


def test_api_key_guards_every_route_but_health(locked):
    assert httpx.get(f"{locked.url}/health").status_code == 200
    for path in ("/v1/models", "/metrics", "/admin/cache"):
        resp = httpx.get(locked.url + path)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
    wrong = httpx.get(f"{locked.url}/v1/models", headers={"Authorization": "Bearer sk-wrong"})
    assert wrong.status_code == 401
    assert httpx.get(f"{locked.url}/v1/models", headers=AUTH).status_code == 200
    models = locked.client(api_key=API_KEY).models.list()
    assert models.data[0].id == MODEL_NAME


def test_admin_needs_the_admin_key(locked):
    assert httpx.get(f"{locked.url}/admin/cache", headers=AUTH).status_code == 401
    ok = httpx.get(f"{locked.url}/admin/cache", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert ok.status_code == 200 and set(ok.json()) >= {"active", "history", "totals"}


def _take(lines: Iterator[str], n: int) -> list[str]:
    out: list[str] = []
    for line in lines:
        if line:
            out.append(line)
        if len(out) == n:
            break
    return out


def test_full_queue_answers_503_with_retry_after(locked):
    with httpx.stream(
        "POST", f"{locked.url}/v1/chat/completions", json=LONG, headers=AUTH
    ) as running:
        lines = running.iter_lines()  # keep a reference: a dropped iterator closes the stream
        assert _take(lines, 2)  # the worker is busy with this one
        waiting = threading.Thread(
            target=httpx.post,
            kwargs=dict(
                url=f"{locked.url}/v1/chat/completions",
                headers=AUTH,
                timeout=60,
                json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 2},
            ),
        )
        waiting.start()
        time.sleep(0.3)  # it now fills the one queue slot
        rejected = httpx.post(
            f"{locked.url}/v1/chat/completions",
            headers=AUTH,
            json={"model": MODEL_NAME, "messages": CHAT, "max_tokens": 2},
        )
        admin = httpx.get(
            f"{locked.url}/admin/cache", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
        ).json()
        assert rejected.status_code == 503, admin["totals"]
        assert int(rejected.headers["retry-after"]) >= 1
        assert rejected.json()["error"]["type"] == "server_error"
    waiting.join(30)
    assert not waiting.is_alive()


def test_sigterm_drains_the_stream_in_flight(locked):
    # Runs last in this module: it stops the server.
    body = {**LONG, "max_tokens": 600}
    with httpx.stream(
        "POST", f"{locked.url}/v1/chat/completions", json=body, headers=AUTH, timeout=60
    ) as resp:
        lines = resp.iter_lines()
        first = _take(lines, 2)
        locked.process.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # The socket stays open while draining; new requests are refused with 503.
        late = httpx.post(f"{locked.url}/v1/chat/completions", headers=AUTH, json=body)
        assert late.status_code == 503 and late.headers["retry-after"]
        rest = [line for line in lines if line]
    events = [line.removeprefix("data: ") for line in first + rest]
    assert events[-1] == "[DONE]"
    final = json.loads(events[-2])
    assert final["choices"][0]["finish_reason"] in ("length", "stop")
    assert locked.process.wait(30) == 0  # a drained server exits cleanly
