"""A real qfserve (uvicorn subprocess on 127.0.0.1) over a tiny random model, per session."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.tiny import save_tiny_model

REPO = Path(__file__).resolve().parents[2]
MODEL_NAME = "qfserve-tiny"  # tests serve a tiny random model under the bundled model's name


@dataclass
class Server:
    process: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kwargs):
        from openai import OpenAI

        kwargs = {"api_key": "unused", "_strict_response_validation": True, **kwargs}
        return OpenAI(base_url=f"{self.url}/v1", max_retries=0, timeout=30, **kwargs)

    def logs(self) -> str:
        return self.log.read_text(errors="replace")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(
    model: Path | str | None,
    log: Path,
    *flags: str,
    timeout: float = 90.0,
    env: dict[str, str] | None = None,
    console_script: bool = False,
) -> Server:
    """Start qfserve on a free port and wait for ``/health`` 200.

    Args:
        model: ``--model`` (``None``: no ``--model``, the default model).
        env: Replaces the environment (default: this process's).
        console_script: Run the installed ``qfserve`` script rather than ``python -m``.
    """
    port = free_port()
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    script = shutil.which("qfserve", path=str(Path(sys.executable).parent))
    command = [script] if console_script and script else [sys.executable, "-m", "server.cli"]
    model_flags = [] if model is None else ["--model", str(model)]
    process = subprocess.Popen(
        [*command, *model_flags, "--port", str(port), *flags],
        cwd=REPO,
        env=env,
        stdout=log.open("wb"),
        stderr=subprocess.STDOUT,
    )
    server = Server(process, port, log)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"qfserve exited with {process.returncode}:\n{server.logs()}")
        try:
            if httpx.get(f"{server.url}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    process.kill()
    raise RuntimeError(f"qfserve did not become healthy:\n{server.logs()}")


def stop_server(server: Server) -> None:
    if server.process.poll() is None:
        server.process.send_signal(signal.SIGTERM)
        try:
            server.process.wait(15)
        except subprocess.TimeoutExpired:
            server.process.kill()
            server.process.wait()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("models") / MODEL_NAME)


@pytest.fixture(scope="session")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "qfserve.log"
    srv = start_server(tiny_model_dir, log, "--max-body-bytes", "65536")
    yield srv
    stop_server(srv)
