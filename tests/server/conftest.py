"""A real qfserve (uvicorn subprocess on 127.0.0.1) over a tiny random model, per session."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from qfserve import testing
from qfserve.testing import REPO, free_port
from tests.tiny import save_tiny_model

if TYPE_CHECKING:
    from openai import OpenAI

__all__ = ["MODEL_NAME", "REPO", "Server", "free_port", "start_server", "stop_server"]

MODEL_NAME = "qfserve-tiny"  # tests serve a tiny random model under the bundled model's name


@dataclass
class Server(testing.ServerProcess):
    """A qfserve subprocess whose clients validate every response strictly."""

    def client(self, **kwargs: Any) -> OpenAI:
        """The official SDK in strict mode (30 s timeout, no retries)."""
        return self.openai(**{"_strict_response_validation": True, "timeout": 30, **kwargs})


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
    server = Server(
        **vars(
            testing.launch(
                "qfserve", model, *flags, log=log, env=env, console_script=console_script
            )
        )
    )
    testing.wait_ready(server, timeout)
    return server


def stop_server(server: Server) -> None:
    server.stop(15)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("models") / MODEL_NAME)


@pytest.fixture(scope="session")
def server(tiny_model_dir, tmp_path_factory) -> Iterator[Server]:
    log = tmp_path_factory.mktemp("logs") / "qfserve.log"
    srv = start_server(tiny_model_dir, log, "--max-body-bytes", "65536")
    yield srv
    stop_server(srv)
