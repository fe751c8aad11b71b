"""What the chat page stands on, without a browser: its files (size, nothing fetched from
elsewhere), how they are served, ``GET /v1/status`` and ``kv_cache_detail`` over HTTP."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from qfserve.server.routes.page import FILES
from tests.server.conftest import MODEL_NAME, start_server, stop_server

LONG = "Remember the number 4821 and the word lantern. " * 30


def test_the_page_is_small_and_names_no_other_origin():
    files = sorted(p for p in FILES.iterdir() if p.is_file())
    assert {p.name for p in files} == {"index.html", "app.js", "style.css"}
    assert sum(p.stat().st_size for p in files) <= 250 * 1024
    for path in files:
        text = path.read_text()
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), path.name
        assert "@import" not in text and "url(" not in text, path.name


def test_the_page_is_served_with_a_policy_that_keeps_it_to_this_server(server):
    page = httpx.get(f"{server.url}/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "connect-src 'self'" in policy
    for name in ("app.js", "style.css"):
        served = httpx.get(f"{server.url}/page/{name}")
        assert served.status_code == 200
        assert served.content == (FILES / name).read_bytes()

    # Sent as written (httpx would resolve the dots itself): the files' folder only.
    def raw(path: str) -> int:
        with httpx.Client() as client:
            request = client.build_request("GET", server.url)
            request.url = request.url.copy_with(raw_path=path.encode())
            return client.send(request).status_code

    assert raw("/page/%61pp.js") == 200  # the raw path reaches the server as sent
    for escape in ("/page/%2e%2e/routes/page.py", "/page/..%2froutes/page.py", "/page/../app.py"):
        assert raw(escape) == 404, escape


def test_no_webui_removes_the_page(tiny_model_dir, tmp_path):
    srv = start_server(tiny_model_dir, tmp_path / "log", "--no-webui")
    try:
        assert httpx.get(f"{srv.url}/").status_code == 404
        assert httpx.get(f"{srv.url}/page/app.js").status_code == 404
        assert httpx.get(f"{srv.url}/v1/status").status_code == 200
    finally:
        stop_server(srv)


def _chat(server, **body) -> httpx.Response:
    payload = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": LONG}],
        "max_tokens": 6,
        "temperature": 0,
        **body,
    }
    return httpx.post(f"{server.url}/v1/chat/completions", json=payload, timeout=60)


def test_status_reports_memory_and_a_requests_own_figures(server):
    done = _chat(server, qfilters_budget=32, kv_method="qfilters").json()
    status = httpx.get(f"{server.url}/v1/status", params={"request": done["id"]}).json()
    assert status["model"] == MODEL_NAME and status["context_length"] > 0
    memory = status["memory"]
    assert memory["max_kv_bytes"] > 0 and memory["weights_bytes"] > 0
    assert memory["kv_used_bytes"] <= memory["max_kv_bytes"]
    mine = status["request"]
    assert mine["state"] == "done"
    for name in ("tokens_seen", "tokens_kept", "kept_bytes", "full_seq_bytes"):
        assert mine[name] == done["kv_cache"][name], name
    missing = httpx.get(f"{server.url}/v1/status", params={"request": "chatcmpl-nope"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "request"


@pytest.mark.parametrize("stream", [False, True])
def test_kv_cache_detail_travels_with_the_answer(server, stream):
    extra = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
    response = _chat(
        server, kv_cache_detail=True, qfilters_budget=24, kv_method="qfilters", **extra
    )
    assert response.status_code == 200
    if stream:
        chunks = [
            json.loads(line[5:])
            for line in response.text.splitlines()
            if line[5:].strip()
            if line.startswith("data:") and "[DONE]" not in line
        ]
        carrying = [c for c in chunks if "kv_cache_detail" in c]
        assert len(carrying) == 1 and carrying[0]["choices"][0]["finish_reason"]
        detail, usage = carrying[0]["kv_cache_detail"], chunks[-1]["usage"]
    else:
        body = response.json()
        detail, usage = body["kv_cache_detail"], body["usage"]
    assert detail["tokens"] == usage["prompt_tokens"]
    per_token = [v for v, n in detail["kept"] for _ in range(n)]
    assert len(per_token) == detail["tokens"]
    assert max(per_token) <= detail["layer_heads"] and min(per_token) == 0
    (runs,) = detail["messages"]
    assert sum(n for _, n in runs) == len(LONG)


def test_kv_cache_detail_is_refused_where_nothing_is_dropped(server):
    response = _chat(server, kv_cache_detail=True, kv_method="full")
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "kv_cache_detail" and "full" in error["message"]
