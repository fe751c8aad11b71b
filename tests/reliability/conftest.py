"""Fixtures of the reliability suite: the size, the figures report and the shared server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.reliability.harness import (
    RESULTS,
    Report,
    Server,
    Size,
    bundled_model,
    current_size,
    start_server,
    stop_server,
)


@pytest.fixture(scope="session")
def size() -> Size:
    return current_size()


@pytest.fixture(scope="session")
def report(size) -> Iterator[Report]:
    rep = Report(size)
    yield rep
    if size.name == "full":  # the CI size prints its figures only
        rep.write(RESULTS)


@pytest.fixture(scope="session")
def model(tmp_path_factory) -> Path:
    return bundled_model(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def server(model, size, tmp_path_factory) -> Iterator[Server]:
    """The bundled model with room for every steady-load client in the queue."""
    log = tmp_path_factory.mktemp("logs") / "main.log"
    srv = start_server(
        model,
        log,
        "--max-queue",
        str(2 * size.steady_clients),
        "--write-timeout",
        str(size.write_timeout),
    )
    yield srv
    stop_server(srv)
