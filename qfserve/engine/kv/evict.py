"""The eviction core: which stored rows survive, written once for every scorer.

Scores are ``(B, H, L)`` float32, higher = keep. The first ``n_sink`` rows and the last
``recent`` rows are protected (ranked as +inf); NaN ranks lowest. Survivors are row indices in
temporal order. Ties are broken deterministically: among equal scores the lower position is
kept.

Two paths: a block eviction (:func:`select_keep`, the plain-MLX path of the fused kernel in
:mod:`qfserve.kernels.qfilters_apply`, so kernel and CPU share one definition) and the decode step,
where exactly one row goes (:func:`select_victim`, O(budget), no sort: the cache then writes
the next token into the freed slot instead of copying the rows).

Chunk-level selection (ChunkKV, arXiv 2502.00299) ranks a block's rows by the mean score of
their chunk, ``position // chunk`` (:func:`chunk_scores`), so :func:`select_keep` keeps whole
chunks: members tie, and ties go lowest position first, so only the chunk at the boundary
can be cut, from its end.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, cast

import mlx.core as mx

from qfserve.engine.kv.attention import native_kernel
from qfserve.engine.kv.scorers import ScoreForm
from qfserve.kernels.qfilters_apply import select_keep_reference

_INF = mx.array(float("inf"), dtype=mx.float32)
_NEG_INF = mx.array(-float("inf"), dtype=mx.float32)
_NONE = mx.array(-1, dtype=mx.int32)  # below every ``order``


def select_keep(scores: mx.array, budget: int, n_sink: int, recent: int) -> mx.array:
    """Indices of the ``budget`` rows to keep, in temporal order (block path).

    Top-``budget`` by score with protected rows forced in. The threshold is the
    ``budget``-th largest score; rows strictly above it are always admitted and rows equal
    to it only while quota remains, lowest position first, so exactly ``budget`` rows
    survive even when scores tie (every protected row ties at +inf).

    Args:
        scores: ``(B, H, L)`` float32 with ``L > budget``.
        budget: Rows to keep, ``n_sink + recent < budget < L``.
    Returns:
        ``(B, H, budget)`` uint32 row indices, ascending.
    """
    return select_keep_reference(scores, budget=budget, n_sink=n_sink, recent=recent)


def select_victim(
    scores: mx.array,
    order: mx.array,
    n_sink: int | mx.array,
    first_recent: int | mx.array,
    held: mx.array | None = None,
) -> mx.array:
    """The slot to free when exactly one row must go (the decode step), O(C), no sort.

    Rows may sit in any slot; ``order`` ranks them in time. The victim is the lowest-scoring
    unprotected row, the latest among ties, which matches :func:`select_keep`'s
    lower-position-first tie-break. Protected: slots ``< n_sink`` (sinks never move), rows
    whose ``order >= first_recent``, and slots ``>= held`` (not yet holding a row).

    Args:
        scores: ``(B, H, C)`` float32 without NaN (callers map NaN to -inf on insertion).
        order: ``(B, H, C)`` int32, distinct per (b, h), increasing with position.
        n_sink: Sink slots at the front (an int, or ``(B, 1, 1)`` per batch row).
        first_recent: ``order`` of the oldest protected recent row (likewise).
        held: ``(B, 1, 1)`` slots holding rows, per batch row (a packed batch's members
            grow at their own pace); ``None``: every slot.
    Returns:
        ``(B, H, 1)`` uint32 slot indices.
    """
    slots = mx.arange(scores.shape[-1], dtype=mx.int32)
    guarded = (slots < n_sink) | (order >= first_recent)
    if held is not None:
        guarded = guarded | (slots >= held)
    masked = mx.where(guarded, _INF, scores)
    tied = masked == masked.min(axis=-1, keepdims=True)
    return mx.argmax(mx.where(tied, order, _NONE), axis=-1, keepdims=True)  # uint32


def _write_and_select(
    keys: mx.array,
    values: mx.array,
    scores: mx.array,
    order: mx.array,
    free: mx.array,
    row: tuple[mx.array, mx.array, mx.array],
    position: mx.array,
    first_recent: mx.array,
    n_sink: int | mx.array,
    held: mx.array | None = None,
    ranked: bool = True,
    token_scores: mx.array | None = None,
    caps: mx.array | None = None,
) -> tuple[mx.array, ...]:
    """A decode step at budget: the new ``row`` (its keys ``(B, H, 1, D)``, values and score
    ``(B, H, 1)``) and its ``position`` (an int32 scalar or ``(B, 1, 1)``) go into the
    ``free`` slot, then the next victim is chosen (:func:`select_victim`, with
    ``first_recent``, ``n_sink`` and ``held`` as there).

    ``ranked``: ``scores`` hold ranks (NaN already mapped to -inf, as the cache stores them);
    otherwise raw scores, mapped for the selection only (as a packed batch stores them).
    ``token_scores`` (a chunked cache's per-token scores, ``(B, H, C)``): the raw score goes
    into the slot there too. ``caps`` (``(B, 1, 1)`` int32, with ``held``): a packed member
    holding fewer slots than its cap is still growing, and its next slot is ``held``.

    Returns:
        The new ``keys``, ``values``, ``scores``, ``order`` and free slot ``(B, H, 1)``, then
        the new ``token_scores`` where given.
    """
    new_keys, new_values, score = row
    slot = free[..., None]  # (B, H, 1, 1)
    tokens = () if token_scores is None else (mx.put_along_axis(token_scores, free, score, axis=2),)
    keys = mx.put_along_axis(keys, slot, new_keys, axis=2)
    values = mx.put_along_axis(values, slot, new_values, axis=2)
    # NaN ranks lowest. Not mx.nan_to_num: its fill values would be constants of every trace,
    # a few bytes kept for each batch shape the step is compiled for.
    if ranked:
        score = mx.where(mx.isnan(score), _NEG_INF, score)
    scores = mx.put_along_axis(scores, free, score, axis=2)
    order = mx.put_along_axis(order, free, mx.broadcast_to(position, free.shape), axis=2)
    rank = scores if ranked else mx.where(mx.isnan(scores), _NEG_INF, scores)
    victim = select_victim(rank, order, n_sink, first_recent, held)
    if caps is not None and held is not None:
        victim = mx.where(held < caps, held.astype(mx.uint32), victim)
    return keys, values, scores, order, victim, *tokens


# Compiled: the step's dozen small ops cost MLX's per-op dispatch each (as much as the rest
# of a layer's cache update on x86-64); compiled they are one call. The shapes are fixed once
# a cache is full, so it traces once per budget (and batch size).
_compiled_write_and_select = mx.compile(_write_and_select)


@lru_cache(maxsize=64)
def int32(value: int) -> mx.array:
    """``value`` as an int32 scalar input, one array per value: a step's layers share their
    position, recent window and sinks instead of each making its own (a few microseconds
    each, thirty layers a step)."""
    return mx.array(value, dtype=mx.int32)


def write_and_select(
    keys: mx.array,
    values: mx.array,
    scores: mx.array,
    order: mx.array,
    free: mx.array,
    row: tuple[mx.array, mx.array, mx.array | ScoreForm],
    position: mx.array,
    first_recent: mx.array,
    n_sink: int | mx.array,
    held: mx.array | None = None,
    ranked: bool = True,
    token_scores: mx.array | None = None,
    caps: mx.array | None = None,
) -> tuple[mx.array, ...]:
    """:func:`_write_and_select`, on the CPU in three native ops where the kernels are set
    (:func:`qfserve.engine.kv.attention.set_native`): even compiled, MLX evaluates the step's
    dozen primitives one by one there (~75 us a layer); elsewhere compiled.

    The new row's score may be given as its scorer's ``project`` or ``hidden`` form
    (:class:`qfserve.engine.kv.scorers.ScoreForm`): the native op then scores the key (a
    matmul and a multiply fewer a layer) or the hidden row (a norm, a product and a
    transpose fewer) itself; elsewhere the form is applied first.
    """
    new_keys, new_values, score = row
    kernel = native_kernel()
    if (
        kernel is None
        or mx.default_device() != mx.cpu
        or not all(a.dtype == mx.float32 for a in (keys, values, scores, new_keys, new_values))
        or not _native_score(score, keys.shape[0])
        or (token_scores is not None and token_scores.dtype != mx.float32)
    ):
        if isinstance(score, ScoreForm):
            score = score.mapped() if score.kind == "hidden" else score.projected(new_keys)
        return cast(
            "tuple[mx.array, ...]",
            _compiled_write_and_select(
                keys,
                values,
                scores,
                order,
                free,
                (new_keys, new_values, score),
                position,
                first_recent,
                n_sink,
                held,
                ranked,
                token_scores,
                caps,
            ),
        )
    ints = [
        (a if a.dtype == mx.int32 else a.astype(mx.int32)) if isinstance(a, mx.array) else int32(a)
        for a in (position, first_recent, n_sink)
    ]
    form = score if isinstance(score, ScoreForm) else None
    projection = form if form is not None and form.kind == "project" else None
    hidden: list[Any] = []  # the hidden row, its norm's weight, the map's weight and bias
    eps = 1e-6
    if form is not None and form.kind == "hidden" and form.hidden is not None:
        x, norm, eps = form.hidden
        hidden = [x, norm, form.direction, form.scale]
    return tuple(
        kernel.evict_step(
            keys,
            values,
            scores,
            order if order.dtype == mx.int32 else order.astype(mx.int32),
            free if free.dtype == mx.uint32 else free.astype(mx.uint32),
            new_keys,
            new_values,
            None if form is not None else score,
            *ints,
            held=held if held is None or held.dtype == mx.int32 else held.astype(mx.int32),
            ranked=ranked,
            direction=None if projection is None else projection.direction,
            scale=None if projection is None else projection.scale,
            token_scores=token_scores,
            caps=caps,
            hidden=hidden,
            eps=eps,
        )
    )


def _native_score(score: mx.array | ScoreForm, batch: int) -> bool:
    """The native step takes this score: float32, a projection whose float32 direction
    and scale are per head or per sequence of this batch, or a float32 hidden map."""
    if isinstance(score, mx.array):
        return score.dtype == mx.float32
    if score.kind == "hidden":
        return score.hidden is not None and all(
            a is not None and a.dtype == mx.float32
            for a in (score.hidden[0], score.hidden[1], score.direction, score.scale)
        )
    parts = [p for p in (score.direction, score.scale) if p is not None]
    return (
        score.kind == "project"
        and score.direction is not None
        and all(p.dtype == mx.float32 and (p.ndim == 2 or p.shape[0] == batch) for p in parts)
    )


def chunk_scores(
    scores: mx.array, positions: mx.array, chunk: int, valid: mx.array | None = None
) -> mx.array:
    """Each row's chunk mean: the mean score of the stored rows sharing ``position // chunk``.

    A NaN score makes its chunk's mean NaN (ranked lowest, as a NaN row would be). Rows are
    grouped by chunk id, not by adjacency, so a chunk split by padding (ragged heads: a
    head's rows, its padding, then the new block) is still one chunk.

    Args:
        scores: ``(B, H, L)`` float32 per-row scores.
        positions: ``(B, H, L)`` int32 absolute positions.
        chunk: Positions per chunk, ``>= 1`` (1 returns ``scores``).
        valid: ``(B, H, L)`` bool, False on padding rows, which join no chunk (their own
            score is returned for them).
    Returns:
        ``(B, H, L)`` float32.
    """
    if chunk == 1:
        return scores
    B, H, L = scores.shape
    real = mx.ones(scores.shape, dtype=mx.bool_) if valid is None else valid
    ids = mx.where(real, positions // chunk, 0)
    n = int(ids.max().item()) + 1  # type: ignore[arg-type]  # block evictions only
    flat = (ids + (mx.arange(B * H, dtype=mx.int32) * n).reshape(B, H, 1)).reshape(-1)
    weight = real.astype(mx.float32).reshape(-1)
    sums = (
        mx.zeros((B * H * n,), dtype=mx.float32)
        .at[flat]
        .add(mx.where(real, scores, 0.0).reshape(-1))
    )
    counts = mx.zeros((B * H * n,), dtype=mx.float32).at[flat].add(weight)
    means = (sums[flat] / mx.maximum(counts[flat], 1.0)).reshape(B, H, L)
    return means if valid is None else mx.where(real, means, scores)


def gather_rows(x: mx.array, idx: mx.array) -> mx.array:
    """Rows ``idx`` of ``x`` along the sequence axis.

    Args:
        x: ``(B, H, L, D)`` or ``(B, H, L)``.
        idx: ``(B, H, K)`` row indices.
    Returns:
        ``(B, H, K, D)`` or ``(B, H, K)``.
    """
    if x.ndim == 4:
        return mx.take_along_axis(x, idx[..., None], axis=2)
    return mx.take_along_axis(x, idx, axis=2)
