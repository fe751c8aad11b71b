"""The one hook on a model's attention: per-head masks for caches that store their heads
ragged (adaptive budgets), caches that attend themselves, and blocked CPU attention.

mlx-lm builds one mask per forward pass from the *first* layer's cache and hands it to every
layer, so a mask that differs per layer and per head cannot travel through ``make_mask``.
What every attention layer does call with its own cache is its module's
``scaled_dot_product_attention(queries, keys, values, cache=..., scale=..., mask=...)``.
:func:`install_head_masks` wraps that one function in the model's module: when the layer's
cache exposes ``head_mask`` (``(B, H_kv, S)`` bool over the keys it just returned, False on
padding), the layer's mask becomes mlx-lm's (causal for a block) AND that one, repeated over
each KV head's query heads. Caches without a ``head_mask`` pass through untouched, so the
model runs unchanged for every other cache.

Through the same function: a cache with an ``attend`` method computes the attention itself
(the KVzip reconstruction pass reads its weights); where the native kernels are set
(:func:`set_native`), a decode step and a prompt block go through them, with the cache's
``head_mask`` as their key mask (and a sliding-window layer's prompt block with its window);
otherwise on the CPU a prompt block goes through
:func:`qfserve.engine.kv.blocked.block_attention` (:func:`set_blocked` turns both block
paths off, leaving MLX's own attention).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_causal_mask
from mlx_lm.models.cache import RotatingKVCache

from qfserve.engine.kv import blocked

_MARK = "_qfserve_head_masks"
_BLOCKED = {"on": True}
_NATIVE: dict[str, Any] = {"kernel": None}


def set_native(kernel: Any) -> None:
    """Send attention with no mask but causal and a cache's per-head one through ``kernel``
    (:mod:`qfserve.kernels.native`): decode steps through its ``decode_attention``, prompt
    blocks through its ``prefill_attention``; ``None`` for MLX's own and the blocked one.
    :mod:`qfserve.engine.models.quantized` sets it with the codes it attaches: one switch for
    the process, whose server serves one model."""
    _NATIVE["kernel"] = kernel


def native_kernel() -> Any:
    """The kernel module :func:`set_native` set (``None``: none)."""
    return _NATIVE["kernel"]


def _native_applies(
    queries: mx.array, keys: Any, mask: Any, sinks: Any, window: int | None = None
) -> bool:
    one = queries.shape[2] == 1
    return (
        _NATIVE["kernel"] is not None
        and sinks is None
        # A block must be causal, or causal within a sliding window (another array mask is a
        # batch's padding: MLX's to apply); over one query "causal" masks nothing.
        and (
            window is not None or isinstance(mask, str) and mask == "causal" or one and mask is None
        )
        and isinstance(keys, mx.array)  # not a quantized cache's (data, scales, biases)
        and keys.shape[2] >= queries.shape[2]  # a block's own keys end the stored ones
        and queries.dtype == keys.dtype == mx.float32
        and mx.default_device() == mx.cpu
        and (one or _BLOCKED["on"])
    )


_WINDOW_MASKS: dict[tuple[int, int, int], bool] = {}


def _sliding_window(queries: mx.array, keys: Any, mask: Any, cache: Any) -> int | None:
    """The window of a sliding-window layer's prompt block whose mask is mlx-lm's own
    ``create_causal_mask(N, S - N, window_size=window)`` (what ``RotatingKVCache.make_mask``
    gives once a block reaches past the window), so the native kernel can apply it; else
    ``None``. The mask is compared once per shape: it is a function of the shape alone."""
    N = queries.shape[2]
    if (
        N < 2
        or not isinstance(cache, RotatingKVCache)
        or not isinstance(mask, mx.array)
        or not isinstance(keys, mx.array)
        or mask.dtype != mx.bool_
        or mask.shape != (N, keys.shape[2])
    ):
        return None
    S, window = keys.shape[2], int(cache.max_size)
    key = (N, S, window)
    if key not in _WINDOW_MASKS:
        expected = create_causal_mask(N, S - N, window_size=window)
        _WINDOW_MASKS[key] = bool(mx.array_equal(mask, expected).item())
    return window if _WINDOW_MASKS[key] else None


def set_blocked(on: bool) -> None:
    """Send CPU prompt blocks through :func:`blocked.block_attention` (``on``, the default) or
    through MLX's own ``scaled_dot_product_attention``."""
    _BLOCKED["on"] = on


def blocked_on() -> bool:
    return _BLOCKED["on"]


def combine_masks(mask: Any, head_mask: mx.array, queries: mx.array) -> mx.array:
    """mlx-lm's ``mask`` (None, ``"causal"`` or an array) AND a per-KV-head one.

    Args:
        mask: What the model passes to attention for this block.
        head_mask: ``(B, H_kv, S)`` bool, True where a stored key may be attended.
        queries: ``(B, H_q, N, D)``; ``H_q`` is a multiple of ``H_kv`` (GQA).
    Returns:
        ``(B, H_q, N, S)`` bool, or float additive where ``mask`` was additive.
    """
    B, Hq, N, _ = queries.shape
    S = head_mask.shape[-1]
    per_head = mx.repeat(head_mask, Hq // head_mask.shape[1], axis=1)[:, :, None, :]
    if mask is None:
        return per_head
    if isinstance(mask, str) or mask.shape[-1] != S:
        # "causal", or an array built from the first layer's cache, whose row count differs
        # from this layer's under adaptive budgets: causal over this layer's rows.
        rows = mx.arange(S - N, S)[:, None]
        mask = rows >= mx.arange(S)[None]
    if mask.dtype == mx.bool_:
        return cast(mx.array, mask & per_head)
    return mx.where(per_head, mask, mx.array(-mx.inf, dtype=mask.dtype))


def _masked(original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, **kwargs):  # type: ignore[no-untyped-def]
        attend = getattr(cache, "attend", None)
        if attend is not None:  # sinks: only a ragged batch's members (BatchCache) take them
            sinks = kwargs.get("sinks")
            extra = {} if sinks is None else {"sinks": sinks}
            return attend(queries, keys, values, scale, mask, **extra)
        head_mask = getattr(cache, "head_mask", None)
        window = None if _NATIVE["kernel"] is None else _sliding_window(queries, keys, mask, cache)
        if _native_applies(queries, keys, mask, kwargs.get("sinks"), window):
            kernel = _NATIVE["kernel"]
            if head_mask is not None and head_mask.shape[1] != keys.shape[1]:
                # A packed batch's mask is one per member (B, 1, S): the kernels read it
                # per KV head, through its strides (a broadcast is not copied).
                head_mask = mx.broadcast_to(head_mask, keys.shape[:3])
            if queries.shape[2] == 1:
                out = kernel.decode_attention(queries, keys, values, scale, key_mask=head_mask)
            else:
                out = kernel.prefill_attention(
                    queries, keys, values, scale, key_mask=head_mask, window=window or 0
                )
            return cast(mx.array, out)
        if _BLOCKED["on"] and blocked.applies(queries, mask, cache, kwargs.get("sinks")):
            return blocked.block_attention(queries, keys, values, scale, key_mask=head_mask)
        if head_mask is not None:
            mask = combine_masks(mask, head_mask, queries)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)

    setattr(scaled_dot_product_attention, _MARK, True)
    return scaled_dot_product_attention


def attend_one(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    head_mask: Any,
    sinks: Any = None,
) -> mx.array:
    """One sequence's decode step over its own rows (a ragged batch's member,
    :class:`qfserve.engine.kv.batch.BatchCache`): the native kernel where it applies, else
    MLX's attention with the per-head mask (and the model's attention sinks)."""
    if _native_applies(queries, keys, None, sinks):
        kernel = _NATIVE["kernel"]
        out = kernel.decode_attention(queries, keys, values, scale, key_mask=head_mask)
        return cast(mx.array, out)
    mask = None if head_mask is None else combine_masks(None, head_mask, queries)
    return mx.fast.scaled_dot_product_attention(
        queries, keys, values, scale=scale, mask=mask, sinks=sinks
    )


def install_head_masks(model: nn.Module) -> None:
    """Make ``model``'s attention honour per-head cache masks (idempotent).

    Raises:
        ValueError: the model's attention does not go through mlx-lm's
            ``scaled_dot_product_attention``, so ragged caches cannot be masked.
    """
    modules = {
        type(layer.self_attn).__module__
        for layer in getattr(model, "layers", [])
        if hasattr(layer, "self_attn")
    }
    if not modules:
        raise ValueError("head-adaptive budgets need a model whose layers have self_attn")
    for name in modules:
        module = sys.modules[name]
        original = getattr(module, "scaled_dot_product_attention", None)
        if original is None:
            raise ValueError(
                f"head-adaptive budgets need attention through mlx-lm's "
                f"scaled_dot_product_attention; {name} does not call it"
            )
        if not getattr(original, _MARK, False):
            module.scaled_dot_product_attention = _masked(original)  # type: ignore[attr-defined]
