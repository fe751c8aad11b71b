"""How chat and text completions spell the same generation: the response models of
:mod:`qfserve.server.openapi`, built here and nowhere else, so a body cannot drift from what
the OpenAPI document says. Bodies are sent with ``exclude_unset``: a field appears when it is
set (``null`` included), as OpenAI's do."""

from __future__ import annotations

from typing import Any, Protocol

from qfserve.engine.text.requests import Finished, TokenLogprob
from qfserve.engine.text.tools import parse_tool_calls, without_open_call
from qfserve.server.openapi import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatDelta,
    ChatLogprob,
    ChatLogprobs,
    ChatMessageOut,
    ChatTokenLogprob,
    Completion,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    KVCacheDetail,
    KVCacheInfo,
    Out,
    PromptTokensDetails,
    ToolCallDelta,
    ToolCallOut,
    Usage,
)


class ResponseFormat(Protocol):
    """Builds one endpoint's bodies and stream chunks from generated text."""

    id_prefix: str
    object: str
    chunk_object: str

    @property
    def body(self) -> type[ChatCompletion] | type[Completion]:
        """The response model of a whole body."""

    @property
    def chunk(self) -> type[ChatCompletionChunk] | type[CompletionChunk]:
        """The response model of one stream chunk."""

    holds_text: bool  # streams send the text at the end (it may turn out to be tool calls)

    def choice(
        self, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str
    ) -> ChatChoice | CompletionChoice: ...

    def chunk_choice(
        self,
        text: str,
        logprobs: list[TokenLogprob] | None,
        finish_reason: str | None,
        *,
        first: bool,
    ) -> ChatChunkChoice | CompletionChoice: ...

    def held_chunk_choice(self, text: str, finish_reason: str) -> tuple[Any, str]: ...


def usage(event: Finished) -> Usage:
    """The ``usage`` of a finished generation."""
    return Usage(
        prompt_tokens=event.prompt_tokens,
        completion_tokens=event.completion_tokens,
        total_tokens=event.prompt_tokens + event.completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=event.cached_tokens),
    )


def kv_cache(event: Finished) -> KVCacheInfo:
    return KVCacheInfo(**event.kv_cache)


def kv_cache_detail(event: Finished) -> dict[str, Any]:
    """The body fields of what the caches held, where the request asked for it."""
    if event.kv_detail is None:
        return {}
    return {"kv_cache_detail": KVCacheDetail(**event.kv_detail)}


def dump(model: Out) -> str:
    """A body as sent: set fields only (``null`` where set to ``None``)."""
    return model.model_dump_json(exclude_unset=True)


def _chat_logprobs(items: list[TokenLogprob] | None) -> ChatLogprobs | None:
    if items is None:
        return None

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    content = [
        ChatTokenLogprob(
            **entry(t.token, t.logprob), top_logprobs=[ChatLogprob(**entry(s, v)) for s, v in t.top]
        )
        for t in items
    ]
    return ChatLogprobs(content=content, refusal=None)


class ChatFormat:
    """Chat bodies; with ``tools``, ``<tool_call>`` blocks in the text become ``tool_calls``
    (and a stream sends its text once generation ended, when the calls are known)."""

    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    body: type[ChatCompletion] = ChatCompletion
    chunk: type[ChatCompletionChunk] = ChatCompletionChunk

    def __init__(self, *, tools: tuple[str, ...] = ()) -> None:
        self.holds_text = bool(tools)
        self._names = tools

    def _split(self, text: str, finish_reason: str | None) -> tuple[str | None, list, str | None]:
        if not self.holds_text:
            return text, [], finish_reason
        content, calls = parse_tool_calls(text, self._names)
        if finish_reason == "length":  # a call cut short: neither a call nor the answer
            content = without_open_call(content)
        return content, calls, ("tool_calls" if calls and finish_reason else finish_reason)

    def choice(
        self, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str
    ) -> ChatChoice:
        content, calls, finish = self._split(text, finish_reason)
        message = ChatMessageOut(role="assistant", content=content, refusal=None)
        if calls:
            message.tool_calls = [ToolCallOut(**c) for c in calls]
        return ChatChoice(
            index=0,
            message=message,
            logprobs=_chat_logprobs(logprobs),
            finish_reason=finish,  # type: ignore[arg-type]
        )

    def held_chunk_choice(self, text: str, finish_reason: str) -> tuple[ChatChunkChoice, str]:
        """The held-back text of a tools stream as one delta, and the finish reason."""
        content, calls, finish = self._split(text, finish_reason)
        delta = ChatDelta(content=content) if content else ChatDelta()
        if calls:
            delta.tool_calls = [ToolCallDelta(index=i, **c) for i, c in enumerate(calls)]
        choice = ChatChunkChoice(index=0, delta=delta, logprobs=None, finish_reason=None)
        return choice, finish or finish_reason

    def chunk_choice(
        self,
        text: str,
        logprobs: list[TokenLogprob] | None,
        finish_reason: str | None,
        *,
        first: bool,
    ) -> ChatChunkChoice:
        if first:
            delta = ChatDelta(role="assistant", content=text)
        else:
            delta = ChatDelta(content=text) if text or finish_reason is None else ChatDelta()
        return ChatChunkChoice(
            index=0,
            delta=delta,
            logprobs=_chat_logprobs(logprobs),
            finish_reason=finish_reason,  # type: ignore[arg-type]
        )


class CompletionFormat:
    id_prefix = "cmpl-"
    object = chunk_object = "text_completion"
    body: type[Completion] = Completion
    chunk: type[CompletionChunk] = CompletionChunk
    holds_text = False

    def __init__(self) -> None:
        self._offset = 0  # text_offset of the next token, across stream chunks

    def _logprobs(self, items: list[TokenLogprob] | None) -> CompletionLogprobs | None:
        if items is None:
            return None
        offsets = []
        for t in items:
            offsets.append(self._offset)
            self._offset += len(t.token)
        return CompletionLogprobs(
            tokens=[t.token for t in items],
            token_logprobs=[t.logprob for t in items],
            top_logprobs=[dict(t.top) for t in items],
            text_offset=offsets,
        )

    def choice(
        self, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None
    ) -> CompletionChoice:
        return CompletionChoice(
            index=0,
            text=text,
            logprobs=self._logprobs(logprobs),
            finish_reason=finish_reason,  # type: ignore[arg-type]
        )

    def chunk_choice(
        self,
        text: str,
        logprobs: list[TokenLogprob] | None,
        finish_reason: str | None,
        *,
        first: bool,
    ) -> CompletionChoice:
        return self.choice(text, logprobs, finish_reason)

    def held_chunk_choice(self, text: str, finish_reason: str) -> tuple[CompletionChoice, str]:
        return self.choice(text, None, None), finish_reason
