"""The reconstruction prompt of KVzip (and of KVzap's targets): the token ids that open each
reconstruction chunk for one tokenizer, as kvpress builds them. Used by the serving pass
(:mod:`qfserve.engine.kv.kvzip`) and by the offline targets (:mod:`.kvzap.targets`), so both
read the same prompt."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

REPEAT_FIRST = "\n\nRepeat the previous context exactly."
REPEAT_NEXT = "\n\nRepeat the part of the previous context exactly, starting with"
PREV_TAIL = 8  # tokens of the previous chunk that open the next chunk's prompt


@dataclass(frozen=True)
class RepeatPrompt:
    """The token ids that open each reconstruction chunk, for one tokenizer.

    Args:
        first: ``REPEAT_FIRST``'s ids.
        next: ``REPEAT_NEXT``'s ids (the previous chunk's tail follows them).
        suffix: What the chat template puts between a user turn and the reply (``"\\n"``
            without a template), as kvpress derives it.
    """

    first: tuple[int, ...]
    next: tuple[int, ...]
    suffix: tuple[int, ...]

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> RepeatPrompt:
        """Derive the ids from ``tokenizer`` (mlx-lm's wrapper or a ``transformers`` one)."""
        suffix_text = "\n"
        if getattr(tokenizer, "chat_template", None):
            dummy = "dummy context"
            separator = "\n" + "#" * len(dummy)
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": dummy + separator}],
                add_generation_prompt=True,
                tokenize=False,
            )
            suffix_text = text.split(separator)[-1]

        def ids(text: str) -> tuple[int, ...]:
            return tuple(tokenizer.encode(text, add_special_tokens=False))

        return cls(ids(REPEAT_FIRST), ids(REPEAT_NEXT), ids(suffix_text))

    def chunks(
        self, tokens: Sequence[int], chunk: int, first: int = 0
    ) -> list[tuple[int, int, list[int]]]:
        """``(start, end, ids)`` per chunk of ``tokens[first:]``: the context span it
        reconstructs and the ids fed for it (prompt, suffix, the span's tokens)."""
        out = []
        for start in range(first, len(tokens), chunk):
            end = min(start + chunk, len(tokens))
            lead = (
                self.first
                if start == 0
                else (*self.next, *tokens[max(0, start - PREV_TAIL) : start])
            )
            out.append((start, end, [*lead, *self.suffix, *tokens[start:end]]))
        return out
