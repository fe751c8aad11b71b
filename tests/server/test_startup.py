"""Start-up that fails fast and says why, and flags readable from the environment."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from tests.server.conftest import REPO, free_port


def qfserve(*args: str, env: dict[str, str] | None = None, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "qfserve.server.cli", *args],
        cwd=REPO,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        **kwargs,
    )


def wait_healthy(port: int, process: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert process.poll() is None, process.stdout.read() if process.stdout else ""
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError("qfserve did not become healthy")


def stop(process: subprocess.Popen) -> str:
    process.send_signal(signal.SIGTERM)
    out, _ = process.communicate(timeout=30)
    return out


def test_port_clash_exits_within_2_s_without_loading_the_model():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        start = time.monotonic()
        process = qfserve("--model", "qfserve-tiny", "--port", str(port))
        out, _ = process.communicate(timeout=30)
        elapsed = time.monotonic() - start
    assert process.returncode == 2
    assert elapsed < 2.0, elapsed
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines == [f"qfserve: error: cannot listen on 127.0.0.1:{port}: Address already in use"]


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_a_port_out_of_range_exits_2_with_one_line(port):
    process = qfserve("--model", "qfserve-tiny", "--port", port)
    out, _ = process.communicate(timeout=30)
    assert process.returncode == 2
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines == [
        f"qfserve: error: cannot listen on 127.0.0.1:{port}: the port must be in 0-65535"
    ]


def test_version():
    out = subprocess.run(
        [sys.executable, "-m", "qfserve.server.cli", "--version"],
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    assert out.returncode == 0 and out.stdout.strip() == "qfserve 0.1.0"


def test_bad_environment_value_is_named():
    out = subprocess.run(
        [sys.executable, "-m", "qfserve.server.cli", "--model", "qfserve-tiny"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "QFSERVE_PORT": "eighty"},
    )
    assert out.returncode == 2 and "QFSERVE_PORT" in out.stderr


def test_environment_sets_flags_and_the_key_file_guards_the_api(tmp_path):
    port = free_port()
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    process = qfserve(
        "--api-key-file",
        str(key),
        env={"QFSERVE_PORT": str(port), "QFSERVE_MODEL": "qfserve-tiny", "QFSERVE_BUDGET": "64"},
    )
    try:
        wait_healthy(port, process)
        url = f"http://127.0.0.1:{port}/v1/models"
        assert httpx.get(url).status_code == 401
        ok = httpx.get(url, headers={"Authorization": "Bearer s3cret"})
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "qfserve-tiny"
        chat = httpx.post(
            f"http://127.0.0.1:{port}/v1/chat/completions",
            headers={"Authorization": "Bearer s3cret"},
            json={
                "model": "qfserve-tiny",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 2,
            },
            timeout=60,
        )
        assert chat.json()["kv_cache"]["budget"] == 64  # QFSERVE_BUDGET is the default
    finally:
        out = stop(process)
    assert f"ready: serving qfserve-tiny on http://127.0.0.1:{port}" in out
    assert "s3cret" not in out
