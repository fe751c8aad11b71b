"""What each route answers, as the OpenAPI document states it: bodies, error statuses and the
SSE stream, so schema-driven clients and fuzzers (schemathesis) can hold the server to it.

The response models document and type the dicts :mod:`qfserve.server.generation` builds; the routes
declare them with ``responses=``. FastAPI's automatic 422 entries are removed: validation
errors are 400s here (see :mod:`qfserve.server.errors`).
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import models_json_schema


class Out(BaseModel):
    """A response body part: a field the code sends but the model does not declare fails
    validation (``tests/server/test_tools.py`` checks real bodies against these)."""

    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(Out):
    cached_tokens: int = Field(description="Prompt tokens a reused KV cache already held.")


class Usage(Out):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class KVCacheInfo(Out):
    """The eviction settings that ran, the filter's source and the final cache statistics."""

    method: str
    budget: int
    budget_source: Literal["auto", "request", "server"] = Field(
        description="auto: the server's --budget auto chose it from the prompt's length and "
        "--max-kv-bytes (method full while the full cache fits); request: qfilters_budget; "
        "server: the server's --budget"
    )
    recent: int
    n_sink: int
    chunk: int = 1
    budget_mode: str = "per_head"
    floor: float | None = None
    threshold: float | None = Field(None, description="kvzap_threshold, where one was sent")
    filter_source: str
    tokens_seen: int
    tokens_kept: int
    kept_bytes: int
    full_seq_bytes: int
    compression_ratio: float
    evictions: int
    evicting_layers: int = Field(
        0, description="layers whose cache evicts (full-attention layers, when the method evicts)"
    )
    window_layers: int = Field(
        0, description="sliding-window layers: mlx-lm's rotating caches, never evicted"
    )
    window_bytes: int = Field(
        0, description="bytes the sliding-window layers hold (in kept_bytes and full_seq_bytes)"
    )


class KVCacheDetail(Out):
    """Which prompt tokens the caches still held when the answer ended (asked for with
    ``kv_cache_detail: true``)."""

    tokens: int = Field(description="prompt tokens")
    layer_heads: int = Field(
        description="(layer, KV head) pairs that hold rows per token: the largest count"
    )
    kept: list[list[int]] = Field(
        description="over the prompt's tokens in order, runs [count, tokens]: how many "
        "(layer, KV head) pairs still hold each token's row"
    )
    messages: list[list[list[int]] | None] = Field(
        description="per message sent (a completion: its text prompt), runs [count, "
        "characters] over its content's characters; null where the content was not text or "
        "the chat template changed it"
    )


class ModelCard(Out):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "qfserve"
    context_length: int


class ModelList(Out):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(Out):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(Out):
    """Every error, in OpenAI's shape."""

    error: ErrorDetail


class ChatLogprob(Out):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(ChatLogprob):
    top_logprobs: list[ChatLogprob]


class ChatLogprobs(Out):
    content: list[ChatTokenLogprob] | None
    refusal: None = None


class FunctionCallOut(Out):
    name: str
    arguments: str = Field(description="The call's arguments, a JSON object as a string.")


class ToolCallOut(Out):
    id: str
    type: Literal["function"]
    function: FunctionCallOut


class ToolCallDelta(ToolCallOut):
    index: int


class ChatMessageOut(Out):
    role: Literal["assistant"]
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCallOut] | None = None


class ChatChoice(Out):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(Out):
    """``stream: false``; with ``stream: true`` the body is ``text/event-stream``."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    kv_cache: KVCacheInfo
    kv_cache_detail: KVCacheDetail | None = None


class CompletionLogprobs(Out):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(Out):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length"] | None


class Completion(Out):
    """``stream: false``; with ``stream: true`` the body is ``text/event-stream``."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    kv_cache: KVCacheInfo
    kv_cache_detail: KVCacheDetail | None = None


class ChatDelta(Out):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Out):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "tool_calls"] | None


class ChatCompletionChunk(Out):
    """One ``data:`` event of a chat stream; the last (with ``include_usage``) has no choices."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    kv_cache: KVCacheInfo | None = None
    kv_cache_detail: KVCacheDetail | None = None


class CompletionChunk(Out):
    """One ``data:`` event of a text-completion stream."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_cache: KVCacheInfo | None = None
    kv_cache_detail: KVCacheDetail | None = None


class HealthStatus(Out):
    status: Literal["ok"]
    model: str
    queue_length: int
    api_key_required: bool = Field(
        description="the other routes want 'Authorization: Bearer <key>' (--api-key)"
    )


_ERRORS = {
    400: "Invalid request; `param` names the field",
    401: "Missing or wrong API key (only when the server has one)",
    404: "Unknown model",
    413: "Body over --max-body-bytes",
    415: "Content-Type is not JSON",
    503: "Loading, draining, queue full or worker down; see Retry-After",
}
_CHUNKS = (ChatCompletionChunk, CompletionChunk, ErrorResponse)


def _sse(chunk: type[BaseModel]) -> dict[str, Any]:
    """One server-sent event (OpenAPI 3.1: ``schema`` describes each event): a JSON chunk,
    an error after the stream began, or the closing ``[DONE]``."""
    payload = {
        "contentMediaType": "application/json",
        "contentSchema": {
            "anyOf": [
                {"$ref": f"#/components/schemas/{chunk.__name__}"},
                {"$ref": "#/components/schemas/ErrorResponse"},
            ]
        },
    }
    event = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string"},
            "data": {"type": "string", "if": {"const": "[DONE]"}, "then": True, "else": payload},
        },
        "description": "`data: {chunk}` events, then `data: [DONE]`; a failure after the "
        "stream began is a `data: {error}` event before `[DONE]`",
    }
    return {"text/event-stream": {"schema": event}}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """``responses=`` entries for these error statuses."""
    return {s: {"model": ErrorResponse, "description": _ERRORS[s]} for s in statuses}


def generation(model: type[BaseModel], chunk: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    """``responses=`` of a generation route: JSON or SSE events, and its errors."""
    ok = {
        "model": model,
        "description": "The completion (JSON) or its stream",
        "content": _sse(chunk),
    }
    return {200: ok, **errors(400, 401, 404, 413, 415, 503)}


def install_openapi(app: FastAPI) -> None:
    """Serve the document without FastAPI's 422 entries (we answer 400)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for operations in schema.get("paths", {}).values():
                for operation in operations.values():
                    operation.get("responses", {}).pop("422", None)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            # The stream chunks are referenced only from the SSE event schema.
            _, chunks = models_json_schema(
                [(m, "serialization") for m in _CHUNKS],
                ref_template="#/components/schemas/{model}",
            )
            for name, definition in chunks.get("$defs", {}).items():
                components.setdefault(name, definition)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
