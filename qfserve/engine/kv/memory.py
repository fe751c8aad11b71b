"""What a request's caches can hold, in bytes, known before they exist.

An evicting cache never holds more than its budget (plus the one free slot of the decode
step's slot layout), so its KV bytes are bounded by its settings alone; a full cache holds
its prompt and its completion; sliding-window layers hold their window (:mod:`.layout`).
Admission (:mod:`qfserve.engine.serving.admission`) reserves these bytes; a method whose
caches hold more at some point (a pass over the prompt) adds its own through its policy
(:meth:`qfserve.engine.kv.methods.Policy.reserve`). Transient rows (a prefill chunk, before
the block eviction trims it) are activations of that step, not cache, and are not counted.
"""

from __future__ import annotations

from typing import Any, cast

from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.layout import layout


def shape(model: Any, config: dict[str, Any]) -> tuple[int, int, int]:
    """(full-attention layers, KV heads, head_dim) from the model's arguments, else its
    ``config.json`` (sliding-window layers: :func:`window_bytes`)."""
    args = getattr(model, "args", None)

    def field(name: str, default: Any = None) -> Any:
        value = getattr(args, name, None) if args is not None else None
        return config.get(name, default) if value is None else value

    layers = (
        layout(model).full_layers
        if getattr(model, "layers", None)
        else int(field("num_hidden_layers"))
    )
    heads = int(field("num_attention_heads"))
    kv_heads = int(field("num_key_value_heads") or heads)
    head_dim = int(field("head_dim") or int(field("hidden_size")) // heads)
    return layers, kv_heads, head_dim


def kv_row_bytes(model: Any, config: dict[str, Any], cache: CacheConfig | None = None) -> int:
    """Bytes one position occupies in one request's caches, over layers and KV heads: keys
    and values, plus an evicting cache's own per-row arrays (its float32 score and int32
    slot order; with true positions kept, per-token scores and positions; with adaptive
    budgets, the padding mask)."""
    layers, kv_heads, head_dim = shape(model, config)
    per_head = 2 * head_dim * activation_bytes(model)
    if cache is not None and cache.evicts:
        per_head += (
            8 + (8 if cache.keeps_positions else 0) + (1 if cache.budget_mode == "adaptive" else 0)
        )
    return layers * kv_heads * per_head


def window_bytes(model: Any, config: dict[str, Any], tokens: int) -> int:
    """Bytes the sliding-window layers hold after ``tokens`` positions (mlx-lm's rotating
    caches: keys and values of their last ``window`` rows, never evicted)."""
    _, kv_heads, head_dim = shape(model, config)
    rows = layout(model).window_rows(tokens) if getattr(model, "layers", None) else 0
    return rows * kv_heads * 2 * head_dim * activation_bytes(model)


def activation_bytes(model: Any) -> int:
    """Bytes per element of the keys the model writes (its norm weights' float type)."""
    from mlx.utils import tree_flatten

    for entry in tree_flatten(model.parameters()):
        name, p = cast("tuple[str, Any]", entry)
        if "norm" in name and hasattr(p, "dtype"):
            return int(p.dtype.size)
    return 4


def kept_rows(cache: CacheConfig, n_kv_heads: int) -> int:
    """Rows a layer's longest head keeps once evicted: the budget, or under adaptive
    budgets the longest head padded to, every other at its floor."""
    if cache.budget_mode == "adaptive":
        return n_kv_heads * cache.budget - (n_kv_heads - 1) * cache.floor_rows
    return cache.budget


def rows_needed(cache: CacheConfig, n_kv_heads: int, prompt_tokens: int, max_tokens: int) -> int:
    """Rows per KV head the request's caches hold at most, by their settings alone."""
    if not cache.evicts:
        return prompt_tokens + max_tokens
    # + the decode step's free slot
    return min(kept_rows(cache, n_kv_heads) + 1, prompt_tokens + max_tokens)


def kv_need(loaded: Any, cache: CacheConfig, prompt_tokens: int, max_tokens: int) -> int:
    """Bytes the request's caches hold at most, by their settings alone (the sliding
    layers' windows included)."""
    row = kv_row_bytes(loaded.model, loaded.config, cache)
    _, kv_heads, _ = shape(loaded.model, loaded.config)
    rows = rows_needed(cache, kv_heads, prompt_tokens, max_tokens)
    windows = window_bytes(loaded.model, loaded.config, prompt_tokens + max_tokens)
    return rows * row + windows


def need_param(cache: CacheConfig) -> str:
    """The setting that bounds a request's KV bytes: its budget, or without eviction its
    ``max_tokens`` (what an error asks the client to lower)."""
    return "budget" if cache.evicts else "max_tokens"
