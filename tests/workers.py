"""An engine :class:`~qfserve.engine.serving.worker.Worker` in a test: built on a loaded model, started,
ready, and stopped when the test is done with it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from qfserve.engine.models.loading import LoadedModel
from qfserve.engine.serving.config import EngineConfig
from qfserve.engine.serving.jobs import Job
from qfserve.engine.serving.worker import Worker
from qfserve.engine.text.requests import Event, Failed, Finished, GenerationRequest


def worker_for(loaded: LoadedModel, **options: Any) -> Worker:
    """A worker that serves ``loaded`` (not started)."""
    return Worker(EngineConfig(model=loaded.name, **options), loader=lambda _ref: loaded)


@contextmanager
def serving(worker: Worker, timeout: float = 60) -> Iterator[Worker]:
    """Start ``worker``, wait until it is ready (its load failing fails the test), stop it
    on exit, waiting up to ``timeout`` for the step in flight (a kvzip pass, a save)."""
    worker.start()
    deadline = time.monotonic() + timeout
    while not worker.ready:
        assert worker.status == "loading" and time.monotonic() < deadline, worker.error
        time.sleep(0.02)
    try:
        yield worker
    finally:
        worker.stop(timeout=timeout)


async def final_event(job: Job) -> Event:
    """The job's ``Finished`` or ``Failed``, skipping what streams before it."""
    while not isinstance(event := await job.next_event(), (Finished, Failed)):
        pass
    return event


def complete(worker: Worker, request: GenerationRequest, timeout: float = 120) -> Event:
    """Submit one request and wait for its ``Finished`` or ``Failed``."""

    async def go() -> Event:
        return await final_event(worker.submit(request, asyncio.get_running_loop()))

    return asyncio.run(asyncio.wait_for(go(), timeout))
