"""Admission by KV memory: what a request's caches can hold, known before it starts.

An evicting cache never holds more than its budget (plus the one free slot of the decode
step's slot layout), so its KV bytes are bounded by its settings alone; a full cache holds
its prompt and its completion. The worker admits a request only while the sum of what the
running ones can hold, plus its own, fits ``max_kv_bytes``; one that can never fit is refused
with the parameter to lower. Transient rows (a prefill chunk, before the block eviction
trims it) are activations of that step, not cache, and are not reserved.
"""

from __future__ import annotations

import os
from typing import Any, cast

from qfserve.engine.kv.config import CacheConfig

DEFAULT_KV_SHARE = 0.25  # of physical memory, when --max-kv-bytes is not given


def default_max_kv_bytes() -> int:
    """A quarter of the machine's physical memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: 4 GiB
        total = 16 * 2**30
    return int(total * DEFAULT_KV_SHARE)


def _shape(model: Any, config: dict[str, Any]) -> tuple[int, int, int]:
    """(layers, KV heads, head_dim) from the model's arguments, else its ``config.json``."""
    args = getattr(model, "args", None)

    def field(name: str, default: Any = None) -> Any:
        value = getattr(args, name, None) if args is not None else None
        return config.get(name, default) if value is None else value

    layers = len(getattr(model, "layers", ())) or int(field("num_hidden_layers"))
    heads = int(field("num_attention_heads"))
    kv_heads = int(field("num_key_value_heads") or heads)
    head_dim = int(field("head_dim") or int(field("hidden_size")) // heads)
    return layers, kv_heads, head_dim


def kv_row_bytes(model: Any, config: dict[str, Any], cache: CacheConfig | None = None) -> int:
    """Bytes one position occupies in one request's caches, over layers and KV heads: keys
    and values, plus an evicting cache's own per-row arrays (its float32 score and int32
    slot order; with chunks, per-token scores and positions; with adaptive budgets, the
    padding mask)."""
    layers, kv_heads, head_dim = _shape(model, config)
    per_head = 2 * head_dim * _activation_bytes(model)
    if cache is not None and cache.evicts:
        per_head += (
            8
            + (8 if cache.chunk > 1 or cache.method == "kvzip" else 0)
            + (1 if cache.budget_mode == "adaptive" else 0)
        )
    return layers * kv_heads * per_head


def _activation_bytes(model: Any) -> int:
    """Bytes per element of the keys the model writes (its norm weights' float type)."""
    from mlx.utils import tree_flatten

    for entry in tree_flatten(model.parameters()):
        name, p = cast("tuple[str, Any]", entry)
        if "norm" in name and hasattr(p, "dtype"):
            return int(p.dtype.size)
    return 4


def rows_needed(cache: CacheConfig, n_kv_heads: int, prompt_tokens: int, max_tokens: int) -> int:
    """Rows per KV head the request's caches hold at most."""
    if not cache.evicts:
        return prompt_tokens + max_tokens
    if cache.budget_mode == "adaptive":  # the longest head, padded: every other at its floor
        rows = n_kv_heads * cache.budget - (n_kv_heads - 1) * cache.floor_rows
    else:
        rows = cache.budget
    rows = min(rows + 1, prompt_tokens + max_tokens)  # + the decode step's free slot
    if cache.method == "kvzip" and prompt_tokens > cache.budget:
        # The reconstruction pass holds the whole prompt plus one chunk of its own rows.
        from qfserve.engine.kv.kvzip import DEFAULT_CHUNK, REPEAT_ROWS

        rows = max(rows, prompt_tokens + min(prompt_tokens, DEFAULT_CHUNK) + REPEAT_ROWS)
    return rows


def kv_need(
    loaded: Any, cache: CacheConfig, prompt_tokens: int, max_tokens: int
) -> tuple[int, str]:
    """(bytes the request's caches hold at most, the parameter that sets them)."""
    row = kv_row_bytes(loaded.model, loaded.config, cache)
    _, kv_heads, _ = _shape(loaded.model, loaded.config)
    rows = rows_needed(cache, kv_heads, prompt_tokens, max_tokens)
    param = "qfilters_budget" if cache.evicts else "max_tokens"
    return rows * row, param


def hold_need(loaded: Any, cache: CacheConfig, prompt_tokens: int, max_tokens: int) -> int | None:
    """Bytes a kvzip request holds when its turn runs on its full cache and is compressed
    only when kept for the next turn: every row, then the reconstruction pass's chunk
    beside them (``None``: the request never holds more than its budget)."""
    total = prompt_tokens + max_tokens
    if cache.method != "kvzip" or total <= cache.budget:
        return None
    from qfserve.engine.kv.kvzip import DEFAULT_CHUNK, REPEAT_ROWS

    rows = total + min(total, DEFAULT_CHUNK) + REPEAT_ROWS
    return rows * kv_row_bytes(loaded.model, loaded.config, cache)


def kvzip_limit(
    loaded: Any, cache: CacheConfig, max_kv_bytes: int, prefill_chunk: int
) -> tuple[int, int] | None:
    """Rows a kvzip prompt too long for ``max_kv_bytes`` may hold before what is read so far
    is compressed, and the bytes it then needs: that many rows, a prefill chunk read beside
    them, and the pass's chunk (``None``: not even the budget fits beside those)."""
    from qfserve.engine.kv.kvzip import DEFAULT_CHUNK, REPEAT_ROWS

    row = kv_row_bytes(loaded.model, loaded.config, cache)
    fit = max_kv_bytes // row - REPEAT_ROWS
    # At most: the limit, a chunk read past it, and a pass over those unscored rows.
    limit = fit // 2 - prefill_chunk
    if limit + prefill_chunk > DEFAULT_CHUNK:
        limit = fit - prefill_chunk - DEFAULT_CHUNK
    if limit <= cache.budget:
        return None
    peak = limit + prefill_chunk + min(DEFAULT_CHUNK, limit + prefill_chunk) + REPEAT_ROWS
    return limit, peak * row
