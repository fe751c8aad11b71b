"""One generation seen from the HTTP side: submit to the worker, then answer as JSON or SSE.

Shared by the chat and text-completion routes; the difference between them is a
:class:`~qfserve.server.formats.ResponseFormat`. The handler awaits the worker's ``Started`` event
before answering, so a prompt that does not fit is a 400 before any SSE byte.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from sse_starlette import EventSourceResponse
from sse_starlette.sse import SendTimeoutError
from starlette.types import Receive, Scope, Send

from qfserve.engine.serving.jobs import Job, WorkerUnavailable
from qfserve.engine.serving.worker import Worker
from qfserve.engine.text.requests import Delta, Event, Failed, Finished, Started, TokenLogprob
from qfserve.server.errors import APIError
from qfserve.server.eviction import http_param
from qfserve.server.formats import ResponseFormat, dump, kv_cache, kv_cache_detail, usage
from qfserve.server.metrics import Metrics
from qfserve.server.openapi import KVCacheDetail, KVCacheInfo
from qfserve.server.schemas import GenerationBody
from qfserve.server.settings import Settings

logger = logging.getLogger(__name__)
_FAILED_STATUS = {"invalid_request": 400, "unavailable": 503, "cancelled": 499, "internal": 500}


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


def check_model(name: str, worker: Worker) -> None:
    """404 in OpenAI's shape unless ``name`` is the served model."""
    loaded = worker.loaded
    if loaded is not None and name not in (loaded.name, loaded.model_id, loaded.source):
        raise APIError(
            404,
            f"the model '{name}' does not exist; this server runs '{loaded.name}'",
            param="model",
            code="model_not_found",
        )


def failure(event: Failed) -> APIError:
    status = _FAILED_STATUS[event.kind]
    headers = {"Retry-After": "5"} if status == 503 else None
    code = {400: "invalid_value", 503: "unavailable", 499: "cancelled"}.get(status, "internal")
    return APIError(
        status, event.message, param=http_param(event.param), code=code, headers=headers
    )


class Stream(EventSourceResponse):
    """SSE whose client must keep reading: a chunk not taken within ``send_timeout`` seconds
    aborts the stream, and closing the body iterator cancels the generation."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        except SendTimeoutError:
            logger.warning(
                "aborted a stream whose client read nothing for %.0f s", self.send_timeout
            )


async def _wait_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Generation:
    """A submitted request: :meth:`start` waits until it runs, then :meth:`json` or
    :meth:`sse` answers."""

    def __init__(
        self,
        body: GenerationBody,
        request: Request,
        *,
        worker: Worker,
        settings: Settings,
        metrics: Metrics,
        fmt: ResponseFormat,
        endpoint: str,
    ) -> None:
        self.body, self.request, self.worker = body, request, worker
        self.settings, self.metrics, self.fmt, self.endpoint = settings, metrics, fmt, endpoint
        self.id = fmt.id_prefix + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.t0 = time.perf_counter()
        self.first_text_at: float | None = None
        self.logprobs = bool(getattr(body, "logprobs", None) not in (None, False))
        self.job: Job | None = None
        self.prompt_tokens = 0

    # -- start ---------------------------------------------------------------------------

    async def start(self) -> Generation:
        """Queue the request and wait until the worker accepted its prompt."""
        check_model(self.body.model, self.worker)  # type: ignore[attr-defined]
        engine_request = self.body.to_engine(self.settings)
        try:
            self.job = self.worker.submit(
                engine_request, asyncio.get_running_loop(), request_id=self.id
            )
        except WorkerUnavailable as exc:
            self._count("rejected")
            raise APIError(
                503,
                str(exc),
                code="unavailable",
                headers={"Retry-After": str(exc.retry_after or 5)},
            ) from None
        try:
            event = await self._next(watch_disconnect=True)
        except ClientGone:
            self._count("cancelled")
            raise APIError(499, "client closed the request", code="cancelled") from None
        if isinstance(event, Failed):
            self._count("rejected" if event.kind == "invalid_request" else "error")
            raise failure(event)
        assert isinstance(event, Started)
        self.prompt_tokens = event.prompt_tokens
        return self

    async def _next(self, *, watch_disconnect: bool) -> Event:
        assert self.job is not None
        get = asyncio.ensure_future(self.job.next_event())
        if not watch_disconnect:
            return await get
        gone = asyncio.ensure_future(_wait_disconnect(self.request))
        try:
            await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if get.done():
            return get.result()
        get.cancel()
        self.job.cancel()
        raise ClientGone

    # -- answers -------------------------------------------------------------------------

    async def json(self) -> Response:
        """The whole completion as one body; a client that leaves cancels generation."""
        text: list[str] = []
        logprobs: list[TokenLogprob] = []
        while True:
            try:
                event = await self._next(watch_disconnect=True)
            except ClientGone:
                self._count("cancelled")
                return APIError(499, "client closed the request", code="cancelled").response()
            if isinstance(event, Delta):
                self._saw_text()
                text.append(event.text)
                logprobs.extend(event.logprobs)
            elif isinstance(event, Finished):
                self._finished(event)
                choice = self.fmt.choice(
                    "".join(text), logprobs if self.logprobs else None, event.finish_reason
                )
                # Each format pairs its own choice model with its body model.
                body = self.fmt.body(
                    **self._envelope(chunk=False),
                    choices=[choice],  # type: ignore[list-item]
                    usage=usage(event),
                    kv_cache=kv_cache(event),
                    **kv_cache_detail(event),
                )
                return Response(dump(body), media_type="application/json")
            elif isinstance(event, Failed):
                self._count("error")
                raise failure(event)

    def sse(self) -> EventSourceResponse:
        """Server-sent events: ``data: {json}\\n\\n`` frames, then ``data: [DONE]``."""
        options = getattr(self.body, "stream_options", None)
        include_usage = bool(options and options.include_usage)
        return Stream(
            self._chunks(include_usage),
            sep="\n",
            ping=0,
            send_timeout=self.settings.write_timeout,
            shutdown_grace_period=self.settings.drain_timeout,
        )

    async def _chunks(self, include_usage: bool) -> AsyncIterator[str]:
        done = False
        held: list[str] = []  # a tools stream's text, sent once the calls are known
        try:
            yield self._chunk("", None, first=True, usage=include_usage)
            while True:
                event = await self._next(watch_disconnect=False)
                if isinstance(event, Delta):
                    self._saw_text()
                    if self.fmt.holds_text:
                        held.append(event.text)
                        continue
                    yield self._chunk(event.text, event.logprobs, usage=include_usage)
                elif isinstance(event, Finished):
                    self._finished(event)
                    finish: str = event.finish_reason
                    if held:
                        choice, finish = self.fmt.held_chunk_choice("".join(held), finish)
                        chunk = self.fmt.chunk(**self._envelope(), choices=[choice])
                        if include_usage:
                            chunk.usage = None
                        yield dump(chunk)
                    yield self._chunk(
                        "",
                        None,
                        finish=finish,
                        usage=include_usage,
                        kv_cache=kv_cache(event),
                        **kv_cache_detail(event),
                    )
                    if include_usage:
                        yield dump(
                            self.fmt.chunk(
                                **self._envelope(),
                                choices=[],
                                usage=usage(event),
                                kv_cache=kv_cache(event),
                            )
                        )
                    done = True
                    yield "[DONE]"
                    return
                elif isinstance(event, Failed):
                    self._count("error")
                    done = True
                    yield json.dumps(failure(event).body())
                    yield "[DONE]"
                    return
        finally:
            if not done and self.job is not None:  # the client left mid-stream
                self.job.cancel()
                self._count("cancelled")

    # -- helpers -------------------------------------------------------------------------

    def _envelope(self, *, chunk: bool = True) -> dict[str, Any]:
        """The fields every body (or stream chunk) of this generation begins with."""
        obj = self.fmt.chunk_object if chunk else self.fmt.object
        return {"id": self.id, "object": obj, "created": self.created, "model": self.body.model}  # type: ignore[attr-defined]

    def _chunk(
        self,
        text: str,
        logprobs: tuple[TokenLogprob, ...] | None,
        *,
        finish: str | None = None,
        first: bool = False,
        usage: bool = False,
        kv_cache: KVCacheInfo | None = None,
        kv_cache_detail: KVCacheDetail | None = None,
    ) -> str:
        lp = list(logprobs) if self.logprobs and logprobs else None
        choice = self.fmt.chunk_choice(text, lp, finish, first=first)
        chunk = self.fmt.chunk(**self._envelope(), choices=[choice])  # type: ignore[list-item]
        if usage:
            chunk.usage = None
        if kv_cache is not None:
            chunk.kv_cache = kv_cache
        if kv_cache_detail is not None:
            chunk.kv_cache_detail = kv_cache_detail
        return dump(chunk)

    def _saw_text(self) -> None:
        if self.first_text_at is None:
            self.first_text_at = time.perf_counter()
            self.metrics.ttft.observe(self.first_text_at - self.t0)

    def _finished(self, event: Finished) -> None:
        self._count("ok")
        self.metrics.latency.observe(time.perf_counter() - self.t0)
        self.metrics.prompt_tokens.inc(event.prompt_tokens)
        self.metrics.completion_tokens.inc(event.completion_tokens)
        self.metrics.kv_kept_total.inc(event.kv_cache.get("kept_bytes", 0))
        self.metrics.kv_full_total.inc(event.kv_cache.get("full_seq_bytes", 0))

    def _count(self, outcome: str) -> None:
        self.metrics.requests.labels(endpoint=self.endpoint, outcome=outcome).inc()
