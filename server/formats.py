"""How chat and text completions spell the same generation as OpenAI JSON payloads."""

from __future__ import annotations

from typing import Any, Protocol

from engine.requests import TokenLogprob


class ResponseFormat(Protocol):
    """Builds one endpoint's bodies and stream chunks from generated text."""

    id_prefix: str
    object: str
    chunk_object: str

    def choice(
        self, text: str, logprobs: list[TokenLogprob] | None, finish_reason: str | None
    ) -> dict[str, Any]: ...

    def chunk_choice(
        self,
        text: str,
        logprobs: list[TokenLogprob] | None,
        finish_reason: str | None,
        *,
        first: bool,
    ) -> dict[str, Any]: ...


def _chat_logprobs(items: list[TokenLogprob] | None) -> dict[str, Any] | None:
    if items is None:
        return None

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    return {
        "content": [
            {**entry(t.token, t.logprob), "top_logprobs": [entry(s, v) for s, v in t.top]}
            for t in items
        ],
        "refusal": None,
    }


class ChatFormat:
    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def choice(self, text, logprobs, finish_reason):
        return {
            "index": 0,
            "message": {"role": "assistant", "content": text, "refusal": None},
            "logprobs": _chat_logprobs(logprobs),
            "finish_reason": finish_reason,
        }

    def chunk_choice(self, text, logprobs, finish_reason, *, first):
        delta: dict[str, Any] = (
            {"role": "assistant", "content": text}
            if first
            else ({"content": text} if text or finish_reason is None else {})
        )
        return {
            "index": 0,
            "delta": delta,
            "logprobs": _chat_logprobs(logprobs),
            "finish_reason": finish_reason,
        }


class CompletionFormat:
    id_prefix = "cmpl-"
    object = "text_completion"
    chunk_object = "text_completion"

    def __init__(self) -> None:
        self._offset = 0  # text_offset of the next token, across stream chunks

    def _logprobs(self, items: list[TokenLogprob] | None) -> dict[str, Any] | None:
        if items is None:
            return None
        offsets = []
        for t in items:
            offsets.append(self._offset)
            self._offset += len(t.token)
        return {
            "tokens": [t.token for t in items],
            "token_logprobs": [t.logprob for t in items],
            "top_logprobs": [dict(t.top) for t in items],
            "text_offset": offsets,
        }

    def choice(self, text, logprobs, finish_reason):
        return {
            "index": 0,
            "text": text,
            "logprobs": self._logprobs(logprobs),
            "finish_reason": finish_reason,
        }

    def chunk_choice(self, text, logprobs, finish_reason, *, first):
        return self.choice(text, logprobs, finish_reason)
