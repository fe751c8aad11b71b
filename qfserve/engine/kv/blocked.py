"""Attention for prompt blocks on MLX's CPU backend, in query tiles with a fused exponential.

Why by hand: on MLX's CPU backend a prompt block's attention costs more than its matrix
products at a few thousand tokens. ``mx.fast.scaled_dot_product_attention`` falls back there to
whole-block ops: a ``(H, N, S)`` logit array tens of megabytes large, then a softmax whose
``exp`` runs at ~20 ns an element (measured on x86-64: ``mx.exp`` is not vectorised there,
and every op over an array larger than the cache runs at memory speed). Two changes make it
2-3x faster on the default model (``bench studies attention``): queries go in tiles of
:data:`TILE` rows, so each tile's logits stay in cache, and the exponential is a compiled
(fused, elementwise) polynomial with exact ``2**n`` scaling, as accurate as ``mx.exp``
(relative error 2e-7 near 0, 4e-6 at -87, float32's rounding of ``x log2 e``) at a quarter of
its time. No library offers this: mlx-lm calls MLX's
attention, and MLX's CPU kernels are what is slow.

A tile's keys are split at an absolute position that is a multiple of :data:`TILE`: the keys
before it (seen by every query of the tile, unmasked) and at most :data:`TILE` keys after it
(causal). Query rows are padded at the front to that alignment, so the shapes a tile meets
are bounded by the context length over :data:`TILE`, and the compiled exponential traces a
bounded number of shapes however prompts are cut.

The same tiles serve the KVzip reconstruction pass (:mod:`qfserve.engine.kv.kvzip`), which
needs the attention weights themselves: ``observe`` sees each tile's exponentials, so the
scores come from the forward pass's own softmax instead of a second one.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

TILE = 32  # query rows per tile (also the alignment of the key split); 32-64 measured best
_LOG2E = 1.4426950408889634
# 2**f on [-1/2, 1/2]: a minimax-weighted fit of exp(f ln 2), relative error 1.9e-7.
_POLY = (1.3264727e-3, 9.6715130e-3, 5.5507336e-2, 2.4022242e-1, 6.9314700e-1, 1.0)
# Adding then subtracting 1.5 * 2**23 rounds a float32 of magnitude < 2**22 to an integer.
_ROUND = 12582912.0

# (first key column, exponentials (B, H, G, T, width)) for each part of a tile's keys.
Parts = list[tuple[int, mx.array]]
Observer = Callable[[int, int, Parts, mx.array], None]


def _shifted_exp(logits: mx.array, top: mx.array) -> mx.array:
    """``exp(logits - top)`` for ``logits <= top``: 2**n by its exponent bits, 2**f by a
    polynomial; exactly 0 below float32's normal range (masked logits are ``-inf``).

    ``n`` is rounded by :data:`_ROUND`'s additions, not ``mx.floor``: MLX's compiler does
    not fuse ``floor``, and the extra array pass it costs made the whole exponential 1.6x
    slower (2.6 against 1.6 ns an element on x86-64)."""
    t = mx.maximum((logits - top) * _LOG2E, -127.0)
    n = (t + _ROUND) - _ROUND
    f = t - n
    p = mx.array(_POLY[0], dtype=mx.float32)
    for c in _POLY[1:]:
        p = p * f + c
    return p * ((n.astype(mx.int32) + 127) << 23).view(mx.float32)


# Compiled per shape (``view`` cannot be traced shapeless); the tiles bound the shapes.
shifted_exp = mx.compile(_shifted_exp)


def applies(queries: mx.array, mask: Any, cache: Any, sinks: Any = None) -> bool:
    """Whether a layer's attention call can take :func:`block_attention`: on the CPU, a block
    of at least :data:`TILE` queries with mlx-lm's causal (or no) mask, float keys."""
    return (
        queries.shape[2] >= TILE
        and (mask is None or isinstance(mask, str) and mask == "causal")
        and sinks is None
        and not hasattr(cache, "bits")
        and mx.default_device() == mx.cpu
    )


def block_attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    scale: float,
    *,
    key_mask: mx.array | None = None,
    observe: Observer | None = None,
) -> mx.array:
    """Causal softmax attention of a block of queries over keys that end with theirs.

    Args:
        queries: ``(B, H_q, N, D)``; query ``i`` sits at key position ``S - N + i``.
        keys: ``(B, H, S, D)`` with ``H`` dividing ``H_q`` (grouped queries).
        values: ``(B, H, S, D_v)``.
        scale: Multiplies the logits.
        key_mask: ``(B, H, S)`` bool, False where a key may not be attended (padding).
        observe: Called per tile as ``observe(first, rows, parts, total)``: the tile's padded
            query rows start at key position ``first`` (``rows`` of them, ``TILE`` padded),
            ``parts`` hold its exponentials by key columns, and ``total`` ``(B, H, G, T, 1)``
            their sum per query (the softmax's denominator).
    Returns:
        ``(B, H_q, N, D_v)`` in ``queries``' dtype.
    """
    B, Hq, N, D = queries.shape
    H, S = keys.shape[1], keys.shape[2]
    G, T = Hq // H, TILE
    first = S - N
    front = first % T  # padding rows that align the first tile to a multiple of T
    q = (queries.astype(mx.float32) * scale).reshape(B, H, G, N, D)
    if front:
        q = mx.concatenate([mx.zeros((B, H, G, front, D), dtype=mx.float32), q], axis=3)
    k, v = keys.astype(mx.float32), values.astype(mx.float32)
    bias = None if key_mask is None else mx.where(key_mask, 0.0, -mx.inf)[:, :, None, None, :]
    tri = mx.where(mx.arange(T)[:, None] >= mx.arange(T)[None], 0.0, -mx.inf)
    outs = []
    for i, start in enumerate(range(first - front, S, T)):
        width = min(start + T, S) - start
        qt = q[:, :, :, i * T : (i + 1) * T]
        rows = qt.shape[3]
        flat = qt.reshape(B, H, G * rows, D)
        diag = (flat @ k[:, :, start : start + width].swapaxes(-1, -2)).reshape(
            B, H, G, rows, width
        )
        diag = diag + tri[:rows, :width]
        if bias is not None:
            diag = diag + bias[..., start : start + width]
        top = diag.max(-1, keepdims=True)
        hist = None
        if start:
            hist = (flat @ k[:, :, :start].swapaxes(-1, -2)).reshape(B, H, G, rows, start)
            if bias is not None:
                hist = hist + bias[..., :start]
            top = mx.maximum(top, hist.max(-1, keepdims=True))
        e_diag = shifted_exp(diag, top)
        total = e_diag.sum(-1, keepdims=True)
        out = e_diag.reshape(B, H, G * rows, width) @ v[:, :, start : start + width]
        parts: Parts = [(start, e_diag)]
        if hist is not None:
            e_hist = shifted_exp(hist, top)
            total = total + e_hist.sum(-1, keepdims=True)
            out = out + e_hist.reshape(B, H, G * rows, start) @ v[:, :, :start]
            parts.insert(0, (0, e_hist))
        if observe is not None:
            observe(start, rows, parts, total)
        outs.append(out.reshape(B, H, G, rows, -1) / total)
    out = mx.concatenate(outs, axis=3)[:, :, :, front:]
    return out.reshape(B, Hq, N, -1).astype(queries.dtype)


def columns(parts: Parts, lo: int, hi: int) -> mx.array:
    """A tile's exponentials over key columns ``[lo, hi)``, across its parts."""
    pieces = []
    for first, e in parts:
        a, b = max(lo, first), min(hi, first + e.shape[-1])
        if a < b:
            pieces.append(e[..., a - first : b - first])
    if not pieces:
        shape = (*parts[0][1].shape[:-1], 0)
        return mx.zeros(shape, dtype=mx.float32)
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=-1)


def column_sum(parts: Parts, lo: int, hi: int) -> mx.array:
    """A tile's exponentials summed over key columns ``[lo, hi)``: ``(B, H, G, T, 1)``."""
    total = mx.zeros((*parts[0][1].shape[:-1], 1), dtype=mx.float32)
    for first, e in parts:
        a, b = max(lo, first), min(hi, first + e.shape[-1])
        if a < b:
            total = total + e[..., a - first : b - first].sum(-1, keepdims=True)
    return total
