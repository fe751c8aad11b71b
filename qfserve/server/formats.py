"""How chat and text completions spell the same generation as OpenAI JSON payloads."""

from __future__ import annotations

from typing import Any, Protocol

from qfserve.engine.text.requests import TokenLogprob
from qfserve.engine.text.tools import parse_tool_calls


class ResponseFormat(Protocol):
    """Builds one endpoint's bodies and stream chunks from generated text."""

    id_prefix: str
    object: str
    chunk_object: str
    holds_text: bool  # streams send the text at the end (it may turn out to be tool calls)

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
    """Chat bodies; with ``tools``, ``<tool_call>`` blocks in the text become ``tool_calls``
    (and a stream sends its text once generation ended, when the calls are known)."""

    id_prefix = "chatcmpl-"
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"

    def __init__(self, *, tools: tuple[str, ...] = ()) -> None:
        self.holds_text = bool(tools)
        self._names = tools

    def _split(self, text: str, finish_reason: str | None) -> tuple[str | None, list, str | None]:
        if not self.holds_text:
            return text, [], finish_reason
        content, calls = parse_tool_calls(text, self._names)
        return content, calls, ("tool_calls" if calls and finish_reason else finish_reason)

    def choice(self, text, logprobs, finish_reason):
        content, calls, finish_reason = self._split(text, finish_reason)
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if calls:
            message["tool_calls"] = calls
        return {
            "index": 0,
            "message": message,
            "logprobs": _chat_logprobs(logprobs),
            "finish_reason": finish_reason,
        }

    def held_chunk_choice(self, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
        """The held-back text of a tools stream as one delta, and the finish reason."""
        content, calls, finish = self._split(text, finish_reason)
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(calls)]
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
        return choice, finish or finish_reason

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
    holds_text = False

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
