"""ASGI middleware: every response counted by status, the request-body size limit (413 before
any handler runs), and a JSON body sent with curl's default form type read as JSON."""

from __future__ import annotations

import json

from prometheus_client import Counter
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from qfserve.server.errors import APIError


class StatusCountMiddleware:
    """Counts every HTTP response by its status (outermost, so the body limit's 413s and
    every error handler's answers count too)."""

    def __init__(self, app: ASGIApp, *, counter: Counter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.counter.labels(status=str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, counted)


class BodyLimitMiddleware:
    """Buffers request bodies up to ``max_bytes`` and answers 413 beyond.

    Checks ``Content-Length`` first and also counts chunked bodies, then replays the body
    to the app; later ``receive`` calls (disconnect notices) pass through. ``curl -d`` sends
    ``application/x-www-form-urlencoded`` (and some clients no type at all): a body that
    parses as a JSON object is then handed on as ``application/json`` (any other type is
    still a 415).
    """

    def __init__(self, app: ASGIApp, *, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break  # the client went away while sending
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._reject(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        scope = _as_json(scope, body)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = APIError(
            413,
            f"request body exceeds the limit of {self.max_bytes} bytes",
            code="request_too_large",
            headers={"Connection": "close"},
        )
        await error.response()(scope, receive, send)


_FORM_TYPES = (b"", b"application/x-www-form-urlencoded")


def _as_json(scope: Scope, body: bytes) -> Scope:
    """``scope`` with its content type made ``application/json`` when a form-typed (or
    untyped) body is a JSON object."""
    headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
    media = dict(scope["headers"]).get(b"content-type", b"").split(b";")[0].strip().lower()
    if media not in _FORM_TYPES:
        return scope
    try:
        if not isinstance(json.loads(body), dict):
            return scope
    except ValueError:
        return scope
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
