"""Attention for prompt blocks on MLX's CPU backend, in query tiles through numpy.

Why by hand: on MLX's CPU backend a prompt block's attention costs more than its matrix
products at a few thousand tokens. ``mx.fast.scaled_dot_product_attention`` falls back there to
whole-block ops: a ``(H, N, S)`` logit array tens of megabytes large, then a softmax whose
``exp`` is a scalar loop (MLX's CPU kernels are compiled without vector instructions on
x86-64: ~2.5 ns an element, where numpy's dispatches to AVX2 / AVX-512 at ~0.3 ns), and
every op over an array larger than the cache runs at memory speed. Here each tile of
:data:`TILE` queries of one KV head's group is one BLAS product over the keys it may see,
numpy's in-place ``exp`` and a second product, so its logits stay in cache: 2.8-3.4x faster
than the same tiles in MLX with a compiled polynomial ``exp`` at 2,048-4,096 keys on the
default model's shapes (``bench ttft`` measures it against MLX's own attention). No library offers
this: mlx-lm calls MLX's attention, and MLX's CPU kernels are what is slow. numpy is already
a dependency of MLX and mlx-lm; its arrays view MLX's evaluated buffers without a copy.

numpy's products run on the calling thread: its BLAS is another library than the one MLX
calls, and two thread pools on the same cores spin against each other (a 2,048-token prefill
of the default model took 14.6 s with numpy's BLAS on two threads, 6.5-7.7 s on one).

Where the native kernels are built (:mod:`qfserve.kernels.native`), their prefill attention
replaces these tiles (the same walk on every core, ~2x faster); this stays the path without
a compiler, and the reference the kernel is tested beside.

The same tiles serve the KVzip reconstruction pass (:mod:`qfserve.engine.kv.kvzip`), which
needs the attention weights themselves: ``observe`` sees each tile's exponentials, so the
scores come from the forward pass's own softmax instead of a second one.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from threadpoolctl import ThreadpoolController

TILE = 64  # query rows per tile; 64 measured best at 2,048-4,096 keys (32-256 within 10%)
MIN_QUERIES = 32  # blocks shorter than this (decode steps) keep MLX's own attention

# observe(b, h, first, exps, total): the tile of KV head ``h`` of sequence ``b`` whose query
# rows sit at key positions ``first, first + 1, ...``; ``exps`` ``(G, rows, end)`` are its
# unnormalised softmax weights over keys ``[0, end)`` (0 where masked), ``total``
# ``(G, rows, 1)`` their sum per query. The tile's output is already computed: the observer
# may overwrite ``exps`` (a scratch buffer it would otherwise allocate).
Observer = Callable[[int, int, int, np.ndarray, np.ndarray], None]


@functools.cache
def _numpy_blas() -> Any:
    """threadpoolctl's controller of numpy's bundled BLAS (its wheels' ``scipy_openblas``),
    not the one MLX was given."""
    return ThreadpoolController().select(prefix="libscipy_openblas")


def applies(queries: mx.array, mask: Any, cache: Any, sinks: Any = None) -> bool:
    """Whether a layer's attention call can take :func:`block_attention`: on the CPU, a block
    of at least :data:`MIN_QUERIES` queries with mlx-lm's causal (or no) mask, float keys."""
    return (
        queries.shape[2] >= MIN_QUERIES
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
        observe: Called per tile with its exponentials (see :data:`Observer`).
    Returns:
        ``(B, H_q, N, D_v)`` in ``queries``' dtype.
    """
    B, Hq, N, D = queries.shape
    H, S = keys.shape[1], keys.shape[2]
    G, first = Hq // H, S - N
    q32, k32, v32 = (a.astype(mx.float32) for a in (queries * scale, keys, values))
    mx.eval(q32, k32, v32)
    q, k, v = np.asarray(q32).reshape(B, H, G, N, D), np.asarray(k32), np.asarray(v32)
    bias = None
    if key_mask is not None:
        bias = np.where(np.asarray(key_mask), np.float32(0.0), np.float32(-np.inf))
    tri = np.triu(np.full((TILE, TILE), -np.inf, dtype=np.float32), 1)
    out = np.empty((B, H, G, N, v.shape[-1]), dtype=np.float32)
    with _numpy_blas().limit(limits=1):
        for b in range(B):
            for h in range(H):
                kt = k[b, h].T
                for lo in range(0, N, TILE):
                    rows = min(TILE, N - lo)
                    end = first + lo + rows
                    e = (q[b, h, :, lo : lo + rows].reshape(G * rows, D) @ kt[:, :end]).reshape(
                        G, rows, end
                    )
                    e[:, :, end - rows :] += tri[:rows, :rows]
                    if bias is not None:
                        e += bias[b, h, :end]
                    np.subtract(e, e.max(axis=-1, keepdims=True), out=e)
                    np.exp(e, out=e)
                    total = e.sum(axis=-1, keepdims=True)
                    o = e.reshape(G * rows, end) @ v[b, h, :end]
                    out[b, h, :, lo : lo + rows] = o.reshape(G, rows, -1) / total
                    if observe is not None:
                        observe(b, h, first + lo, e, total)
    return mx.array(out).reshape(B, Hq, N, -1).astype(queries.dtype)
