"""A request as the worker holds it: the handler's side of the channel to the model thread.

A :class:`Job` carries the request, its record and an asyncio queue of events; the worker
thread posts to it with ``loop.call_soon_threadsafe`` and the handler awaits them. Either
side may cancel it. Under :mod:`qfserve.engine.serving.lockstep` a cancellation takes effect
only when the model thread applies it at a step boundary, so every rank drops the request at
the same step.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qfserve.engine.serving.records import RequestRecord, State
from qfserve.engine.text.requests import Event, Failed, GenerationRequest

if TYPE_CHECKING:
    from qfserve.engine.kv.config import CacheConfig
    from qfserve.engine.kv.methods import Policy, Reservation


class WorkerUnavailable(RuntimeError):
    """The worker cannot take the request now (loading, dead, draining or queue full)."""

    def __init__(self, message: str, *, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Job:
    """One submitted request: the handler awaits :meth:`next_event` and may :meth:`cancel`."""

    def __init__(
        self,
        request: GenerationRequest,
        record: RequestRecord,
        loop: asyncio.AbstractEventLoop | None,
        *,
        deferred: bool = False,
    ) -> None:
        self.request = request
        self.record = record
        self._loop = loop  # None: nobody listens (a follower rank's copy of the request)
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._asked = threading.Event()
        self._cancel = threading.Event()
        self._deferred = deferred  # cancel() only asks; apply_cancel() makes it so
        self.failure: Failed | None = None  # what a cancelled job tells its client, if anyone
        self._emitted = 0  # written by the worker thread only
        self._taken = 0  # written by the event loop only

    @property
    def id(self) -> str:
        return self.record.id

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def cancel(self, failure: Failed | None = None) -> None:
        """Stop this request: dropped if still queued, else within one decode step.

        Args:
            failure: Sent to a client that is still listening (e.g. the server is shutting
                down); ``None`` when the client itself went away.
        """
        if failure is not None and not self._asked.is_set():
            self.failure = failure
        self._asked.set()
        if not self._deferred:
            self._cancel.set()

    @property
    def cancel_asked(self) -> bool:
        """:meth:`cancel` was called (applied or not yet)."""
        return self._asked.is_set()

    def apply_cancel(self, failure: Failed | None = None) -> None:
        """Make a cancellation take effect (the model thread, at a step boundary)."""
        if failure is not None and not self._asked.is_set():
            self.failure = failure
        self._asked.set()
        self._cancel.set()

    def emit(self, event: Event) -> None:
        """Post an event to the handler's loop (called from the worker thread); a failure's
        reason is kept on the record for the admin endpoint."""
        if isinstance(event, Failed) and self.record is not None:
            self.record.error = f"{event.kind}: {event.message}"
        if self._loop is None:
            return
        # A closed loop (server shut down) means nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._events.put_nowait, event)
            self._emitted += 1

    @property
    def backlog(self) -> int:
        """Events posted that the handler has not taken yet."""
        return self._emitted - self._taken

    async def next_event(self) -> Event:
        event = await self._events.get()
        self._taken += 1
        return event


@dataclass
class Admission:
    """A request prepared for the batch: its prompt encoded, the cache settings it runs with
    (an ``auto`` budget resolved), its caches built (a reused one holds the first ``cached``
    prompt tokens), their method's policy and the KV bytes to reserve."""

    job: Job
    prompt: list[int]
    max_tokens: int
    cache: CacheConfig
    caches: list[Any]
    policy: Policy
    reservation: Reservation
    cached: int = 0


@dataclass
class KeptTurn:
    """A turn that ended by EOS or ``max_tokens``: its caches hold every token its client
    got back, so the next turn may continue them (multi-turn reuse)."""

    request: GenerationRequest
    cache: CacheConfig  # the settings it ran with
    tokens: list[int]  # prompt then generated, as the caches hold them
    caches: list[Any]


@dataclass
class Departure:
    """A request that left the scheduler: its record's final state, and the turn to keep
    when it ended normally and asked for reuse."""

    record: RequestRecord
    state: State
    turn: KeptTurn | None = None
