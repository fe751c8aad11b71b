"""A served session on the sanitized native kernels (``tests/kernels/sanitized.sh`` runs it;
skipped elsewhere): 100 requests over every method, streamed and not, then a clean stop,
with no AddressSanitizer or UndefinedBehaviorSanitizer report in the server's log."""

from __future__ import annotations

import os
import random

import httpx
import pytest

from qfserve import testing

pytestmark = pytest.mark.skipif(
    os.environ.get("QFSERVE_NATIVE_SANITIZE") != "1"
    or "libasan" not in os.environ.get("LD_PRELOAD", ""),
    reason="runs under tests/kernels/sanitized.sh (the ASan + UBSan build, libasan preloaded)",
)
METHODS = ("qfilters", "kvzip", "kvzap", "knorm", "streaming", "snapkv", "tova", "full")


def test_a_sanitized_server_answers_100_requests_with_no_report(tmp_path):
    log = tmp_path / "server.log"
    server = testing.launch("qfserve", None, "--max-batch", "8", log=log, log_level="warning")
    try:
        testing.wait_ready(server, 600)
        rng = random.Random(0)
        with httpx.Client(timeout=600) as client:
            model = client.get(f"{server.url}/v1/models").json()["data"][0]["id"]
            for i in range(100):
                method = METHODS[i % len(METHODS)]
                body = {
                    "model": model,
                    "messages": [{"role": "user", "content": "count " * rng.choice((3, 60, 300))}],
                    "max_tokens": rng.choice((4, 16)),
                    "kv_method": method,
                    "stream": i % 2 == 0,
                }
                if method != "full":
                    body["qfilters_budget"] = rng.choice((32, 128))
                r = client.post(f"{server.url}/v1/chat/completions", json=body)
                assert r.status_code == 200, (i, method, r.text[:300], log.read_text()[-3000:])
    finally:
        status = server.stop(60)
    text = log.read_text()
    assert "AddressSanitizer" not in text and "runtime error:" not in text, text[-5000:]
    assert status == 0, text[-3000:]
