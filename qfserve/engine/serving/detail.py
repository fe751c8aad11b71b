"""A finished request's ``kv_cache_detail``: which of its prompt tokens its caches still
hold, compact enough to travel on the final stream chunk.

``kept`` run-length codes, over the prompt's tokens, how many (layer, KV head) pairs hold the
token's row (:func:`qfserve.engine.kv.held.held_counts`); ``layer_heads`` is how many pairs
there are. ``messages`` maps the same counts onto the characters of each message the client
sent (chat) or of its text prompt (completion), so a page can shade the text it shows without
a tokenizer: the prompt is detokenized token by token, each message's content is found in
that text in order, and each of its characters takes its token's count. A message whose text
the template changed (so it cannot be found) gets ``null``. Nothing is stored server-side.
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Any

import numpy as np

from qfserve.engine.kv.held import held_counts


def runs(values: list[int] | np.ndarray, lengths: list[int] | None = None) -> list[list[int]]:
    """Run-length code: ``[[value, length], ...]``, adjacent equal values merged (``lengths``:
    each value's own length, default 1)."""
    out: list[list[int]] = []
    for i, v in enumerate(values):
        n = 1 if lengths is None else lengths[i]
        if n <= 0:
            continue
        if out and out[-1][0] == int(v):
            out[-1][1] += n
        else:
            out.append([int(v), n])
    return out


def token_ends(tokenizer: Any, tokens: list[int], context: int = 8) -> tuple[str, list[int]]:
    """The text ``tokens`` decode to and, per token, the length of that text up to its end.

    Why not the streaming detokenizer: it holds a token's text back until the next one
    arrives (a lone space, half a character), which would shade that text with the wrong
    token's count. Decoding every prefix is exact but quadratic, so each token's length is
    the difference it makes to the decoded text of the ``context`` tokens before it: a
    leading space a tokenizer strips, or a character split over tokens, is in both decodes
    and cancels (a split character goes to the token that completes it)."""
    windows = []
    for i in range(len(tokens)):
        first = max(0, i - context)
        windows += [tokens[first:i], tokens[first : i + 1]]
    decode = getattr(tokenizer, "batch_decode", None)
    texts = decode(windows) if decode is not None else [tokenizer.decode(w) for w in windows]
    text = tokenizer.decode(tokens)
    ends, at = [], 0
    for before, after in zip(texts[::2], texts[1::2], strict=True):
        at = min(len(text), at + max(0, len(after) - len(before)))
        ends.append(at)
    if ends:
        ends[-1] = len(text)
    return text, ends


def text_runs(
    counts: np.ndarray,
    text: str,
    ends: list[int],
    contents: list[str | None],
    anchors: list[str | None] | None = None,
) -> list[list[list[int]] | None]:
    """Per content string: runs of ``[count, characters]`` (code points) over its
    characters, found in ``text`` in order after the previous one (``None`` where not
    found). Each content is looked for after its anchor where the anchor is found (a chat
    message's role: a message saying "user" is its own text, not the template's header)."""
    out: list[list[list[int]] | None] = []
    cursor = 0
    for content, anchor in zip(contents, anchors or [None] * len(contents), strict=True):
        if content is None:
            out.append(None)
            continue
        if anchor and (at := text.find(anchor, cursor)) >= 0:
            cursor = at + len(anchor)
        start = text.find(content, cursor) if content else -1
        if start < 0:
            out.append(None if content else [])
            continue
        stop = start + len(content)
        values, lengths = [], []
        i = bisect_right(ends, start)  # the first token ending after ``start``
        at = start
        while at < stop and i < len(ends):
            end = min(ends[i], stop)
            values.append(int(counts[i]))
            lengths.append(end - at)
            at, i = end, i + 1
        out.append(runs(values, lengths))
        cursor = stop
    return out


def contents_of(request: Any) -> tuple[list[str | None], list[str | None]]:
    """The texts the client sent, in order, and what each follows in the prompt: each chat
    message's string content (``None`` for other content) after its role, or a completion's
    text prompt (nothing for token ids)."""
    if request.kind == "chat":
        contents = [m.get("content") for m in request.messages]
        return [c if isinstance(c, str) else None for c in contents], [
            m.get("role") for m in request.messages
        ]
    return ([request.prompt], [None]) if isinstance(request.prompt, str) else ([], [])


def kv_cache_detail(
    caches: list[Any], prompt: list[int], tokenizer: Any, request: Any
) -> dict[str, Any]:
    """The ``kv_cache_detail`` of a request that ended with ``caches`` over ``prompt``."""
    counts, pairs = held_counts(caches, len(prompt))
    text, ends = token_ends(tokenizer, prompt)
    return {
        "tokens": len(prompt),
        "layer_heads": pairs,
        "kept": runs(counts),
        "messages": text_runs(counts, text, ends, *contents_of(request)),
    }
