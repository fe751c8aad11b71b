"""What KVzip asks of serving beyond its scores (:class:`qfserve.engine.kv.methods.Policy`).

- **Reserve** the pass: a prompt over its budget is stored whole, then scored by the
  reconstruction pass, which holds the prompt and one chunk of its own rows.
- **Under memory pressure** (the whole prompt would not fit ``--max-kv-bytes``), compress
  what is read so far whenever the layers reach a limit (:func:`compress_as_read`), then read
  on; the reservation is the limit's.
- **A turn kept for reuse** may answer on its full cache where that fits beside the others
  (the preferred reservation), and is compressed only when kept, so the next turn continues a
  bounded cache scored without knowing its question.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qfserve.calibrations.repeat import RepeatPrompt
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.kvzip.reconstruction import Reconstruction, settle
from qfserve.engine.kv.kvzip.scorer import (
    DEFAULT_CHUNK,
    REPEAT_ROWS,
    beyond_keep,
    hold,
    needs_pass,
    over_limit,
    set_limit,
)
from qfserve.engine.kv.memory import (
    kept_rows,
    kv_need,
    kv_row_bytes,
    need_param,
    shape,
    window_bytes,
)
from qfserve.engine.kv.methods import Policy, Reservation, Work


def pass_rows(tokens: int) -> int:
    """Rows per head a pass over ``tokens`` stored rows holds: them, one chunk of its own
    rows and its prompt."""
    return tokens + min(tokens, DEFAULT_CHUNK) + REPEAT_ROWS


def kvzip_need(loaded: Any, cache: CacheConfig, prompt_tokens: int, max_tokens: int) -> int:
    """Bytes a kvzip request holds at most: its settings' bound, or a pass over a prompt
    longer than its budget."""
    need = kv_need(loaded, cache, prompt_tokens, max_tokens)
    if prompt_tokens <= cache.budget:
        return need
    row = kv_row_bytes(loaded.model, loaded.config, cache)
    windows = window_bytes(loaded.model, loaded.config, prompt_tokens + max_tokens)
    return max(need, pass_rows(prompt_tokens) * row + windows)


def whole_need(loaded: Any, cache: CacheConfig, prompt_tokens: int, max_tokens: int) -> int | None:
    """Bytes a kvzip request holds when its turn runs on its full cache and is compressed
    only when kept for the next turn: every row, then the pass's chunk beside them
    (``None``: the request never holds more than its budget)."""
    total = prompt_tokens + max_tokens
    if total <= cache.budget:
        return None
    windows = window_bytes(loaded.model, loaded.config, total)
    return pass_rows(total) * kv_row_bytes(loaded.model, loaded.config, cache) + windows


def compress_as_read(
    loaded: Any, cache: CacheConfig, max_kv_bytes: int, prefill_chunk: int
) -> tuple[int, int] | None:
    """Rows a kvzip prompt too long for ``max_kv_bytes`` may hold before what is read so far
    is compressed, and the bytes it then needs: that many rows, a prefill chunk read beside
    them, and the pass's chunk (``None``: not even what a compressed layer keeps fits
    beside those). Layers are counted together (:func:`.scorer.over_limit`): the limit is
    their mean."""
    row = max(1, kv_row_bytes(loaded.model, loaded.config, cache))
    # The sliding layers' windows fill first (a long prompt's are full): the rest is the limit's.
    windows = window_bytes(loaded.model, loaded.config, 2**31)
    fit = (max_kv_bytes - windows) // row - REPEAT_ROWS
    read = prefill_chunk + 1  # a read may take one token more: no one-token chunk is left
    # At most: the limit, a chunk read past it, and a pass over those unscored rows.
    limit = fit // 2 - read
    if limit + read > DEFAULT_CHUNK:
        limit = fit - read - DEFAULT_CHUNK
    # What a compressed layer keeps, padded to its longest head (rows shared across layers
    # are capped to fit instead: qfserve.engine.kv.kvzip.shares).
    if limit <= kept_rows(cache, shape(loaded.model, loaded.config)[1]):
        return None
    return limit, pass_rows(limit + read) * row + windows


class KVzipPolicy(Policy):
    """KVzip's policy (see the module doc); the pass's prompts are built once per model."""

    def reserve(
        self,
        loaded: Any,
        prompt_tokens: int,
        max_tokens: int,
        *,
        max_kv_bytes: int,
        prefill_chunk: int,
        kept: bool,
    ) -> Reservation:
        config = self.config
        need = kvzip_need(loaded, config, prompt_tokens, max_tokens)
        if need > max_kv_bytes:
            fit = compress_as_read(loaded, config, max_kv_bytes, prefill_chunk)
            if fit is not None:
                set_limit(self.caches, fit[0], prefill_chunk)
                # A kept turn compressed without a limit may hold more than a pass leaves
                # (a position's bytes over every layer, divided by the layers: a layer-row's).
                layers = shape(loaded.model, loaded.config)[0]
                layer_row = kv_row_bytes(loaded.model, loaded.config, config) // max(1, layers)
                need = fit[1] + beyond_keep(self.caches) * layer_row
        prefer = whole_need(loaded, config, prompt_tokens, max_tokens) if kept else None
        return Reservation(need, need_param(config), prefer)

    def admitted(self, preferred: bool) -> None:
        hold(self.caches, preferred)  # the turn answers on its full cache; kept, compressed

    def after_read(self, tokens: Sequence[int]) -> Work | None:
        if not over_limit(self.caches):
            return None
        # The whole prompt would not fit the memory it may hold: compress what is read so
        # far, then read on.
        return self._pass(tokens)

    def before_decode(self, tokens: Sequence[int]) -> Work | None:
        return self._pass(tokens) if needs_pass(self.caches) else None

    def before_keep(self, tokens: Sequence[int]) -> None:
        context = self.context
        settle(context.model, self.caches, tokens, self._repeat, group=context.group)

    def _pass(self, tokens: Sequence[int]) -> Reconstruction:
        context = self.context
        return Reconstruction(context.model, self.caches, tokens, self._repeat, group=context.group)

    @property
    def _repeat(self) -> RepeatPrompt:
        """The tokenizer's reconstruction prompts (built for the model's first kvzip request)."""
        tokenizer = self.context.tokenizer
        repeat = self.context.once("kvzip.repeat", lambda: RepeatPrompt.for_tokenizer(tokenizer))
        assert isinstance(repeat, RepeatPrompt)
        return repeat
