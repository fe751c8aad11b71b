"""A model file qfserve cannot serve stops it at start-up: exit non-zero, the file and the
reason on stderr, and the port never bound."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest

from tests.gguf_files import write_other_architecture, write_tiny_gguf, write_with_q8_1
from tests.server.conftest import REPO, free_port


def run_refused(model: str, tmp_path) -> tuple[int, str]:
    """Run ``qfserve --model <model>``; fail if its port ever accepts a connection."""
    port = free_port()
    env_cache = tmp_path / "cache"
    process = subprocess.Popen(
        [sys.executable, "-m", "qfserve.server.cli", "--model", model, "--port", str(port)],
        cwd=REPO,
        env={**os.environ, "QFSERVE_CACHE": str(env_cache)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 60
    while process.poll() is None and time.monotonic() < deadline:
        with socket.socket() as sock:
            sock.settimeout(0.2)
            assert sock.connect_ex(("127.0.0.1", port)) != 0, "the port was bound"
        time.sleep(0.05)
    out, err = process.communicate(timeout=10)
    assert "Uvicorn running" not in out + err
    return process.returncode, err


def _truncated(tmp_path):
    path = tmp_path / "truncated.gguf"
    write_tiny_gguf(path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size * 2 // 3])
    return path


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (_truncated, r"truncated|not a readable GGUF file"),
        (
            lambda p: write_other_architecture(p / "gpt2.gguf", "gpt2"),
            "unsupported architecture 'gpt2'",
        ),
        (lambda p: write_with_q8_1(p / "q8_1.gguf"), "unsupported tensor type Q8_1"),
    ],
    ids=["truncated", "architecture", "tensor-type"],
)
def test_unservable_gguf_exits_before_binding_naming_file_and_reason(tmp_path, make, reason):
    path = make(tmp_path)
    code, err = run_refused(str(path), tmp_path)
    assert code != 0
    assert str(path) in err and re.search(reason, err), err
    assert "Traceback" not in err


def test_missing_path_says_it_is_missing(tmp_path):
    code, err = run_refused("./models/missing", tmp_path)
    assert code != 0
    assert "'./models/missing' looks like a path, but nothing is there" in err
    assert "HFValidationError" not in err


def test_a_hub_id_that_cannot_be_fetched_fails_before_the_port_once(tmp_path, monkeypatch):
    # Offline (as this machine is, and as HF_HUB_OFFLINE makes it anywhere): the id is
    # neither cached nor fetchable.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    code, err = run_refused("someorg/no-such-model", tmp_path)
    assert code == 2
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(
        "qfserve: error: --model 'someorg/no-such-model'"
    )
    assert "cannot be fetched" in errors[0]
