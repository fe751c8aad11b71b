"""What each route answers, as the OpenAPI document states it: bodies, error statuses and the
SSE stream, so schema-driven clients and fuzzers (schemathesis) can hold the server to it.

The response models document and type the dicts :mod:`server.generation` builds; the routes
declare them with ``responses=``. FastAPI's automatic 422 entries are removed: validation
errors are 400s here (see :mod:`server.errors`).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from server.schemas import KVCacheInfo, Usage


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error, in OpenAI's shape."""

    error: ErrorDetail


class ChatLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatLogprob):
    top_logprobs: list[ChatLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"]
    content: str | None
    refusal: None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length"]


class ChatCompletion(BaseModel):
    """``stream: false``; with ``stream: true`` the body is ``text/event-stream``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kv_cache: KVCacheInfo


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class Completion(BaseModel):
    """``stream: false``; with ``stream: true`` the body is ``text/event-stream``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    kv_cache: KVCacheInfo


class HealthStatus(BaseModel):
    status: Literal["ok"]
    model: str
    queue_length: int


_ERRORS = {
    400: "Invalid request; `param` names the field",
    401: "Missing or wrong API key (only when the server has one)",
    404: "Unknown model",
    413: "Body over --max-body-bytes",
    415: "Content-Type is not JSON",
    503: "Loading, draining, queue full or worker down; see Retry-After",
}
_SSE = {
    "text/event-stream": {
        "schema": {
            "type": "string",
            "description": "`data: {chunk}` frames, then `data: [DONE]`; a failure after "
            'the stream began arrives as `data: {"error": ...}` before `[DONE]`',
        }
    }
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for these error statuses."""
    return {s: {"model": ErrorResponse, "description": _ERRORS[s]} for s in statuses}


def generation(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a generation route: JSON or SSE, and its errors."""
    ok = {"model": model, "description": "The completion (JSON) or its stream", "content": _SSE}
    return {200: ok, **errors(400, 401, 404, 413, 415, 503)}


def install_openapi(app: FastAPI) -> None:
    """Serve the document without FastAPI's 422 entries (we answer 400)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
