"""The bounded FIFO between the event loop's handlers and the model thread.

A handler's request is opened in the :class:`~qfserve.engine.serving.records.Ledger` before it
is queued (the model thread may take it and close it at once), and a full queue refuses it
with a retry hint instead of letting waits grow without bound.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
from collections.abc import Callable

from qfserve.engine.serving.jobs import Job, WorkerUnavailable
from qfserve.engine.serving.records import Ledger, RequestRecord
from qfserve.engine.text.requests import GenerationRequest


class Intake:
    """Queued requests, oldest first.

    Args:
        max_queue: Requests that may wait at once.
        ledger: Where a request is opened when queued (and discarded when refused).
    """

    def __init__(self, max_queue: int, ledger: Ledger) -> None:
        self.queue: queue.Queue[Job] = queue.Queue(maxsize=max_queue)
        self._ledger = ledger
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return self.queue.qsize()

    def put(
        self,
        request: GenerationRequest,
        loop: asyncio.AbstractEventLoop,
        model: str,
        request_id: str | None,
        *,
        deferred: bool,
    ) -> Job:
        """Queue ``request`` for ``model`` as a job whose events go to ``loop`` (its id:
        ``request_id``, else a counter; ``deferred``: see :class:`Job`); raises
        :class:`WorkerUnavailable` when the queue is full."""
        request_id = request_id or f"req-{next(self._ids)}"
        record = RequestRecord.opened(request_id, model, request.kind, request.cache.method)
        job = Job(request, record, loop, deferred=deferred)
        self._ledger.open(job)
        try:
            self.queue.put_nowait(job)
        except queue.Full:
            self._ledger.discard(job)
            raise WorkerUnavailable(
                f"too many requests waiting ({self.queue.maxsize}); retry shortly",
                retry_after=1,
            ) from None
        return job

    def take(self, wait: bool) -> Job | None:
        """The oldest request (``wait``: up to 0.2 s for one; ``None``: none came)."""
        try:
            return self.queue.get(timeout=0.2) if wait else self.queue.get_nowait()
        except queue.Empty:
            return None

    def clear(self, end: Callable[[Job], None]) -> None:
        """Hand every waiting request to ``end``."""
        while (job := self.take(False)) is not None:
            end(job)
