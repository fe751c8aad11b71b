"""Dispatch 2, apply: keep ``budget`` rows per (b, h) group, in temporal order, in one launch.

The threshold is the ``budget``-th largest ranked score, found on the MLX side with
``mx.partition``. The kernel (:data:`qfserve.kernels.sources.APPLY`) then admits rows in two tiers —
strictly above the threshold always, equal to it only while quota remains, lowest position
first — and copies the survivors' keys, values and scores bit for bit. The plain-MLX
reference below is the same selection written with MLX ops; it is the CPU path and the
oracle for the kernel, and it equals ``qfserve.engine.kv.evict.select_keep`` + ``gather_rows``.
"""

from __future__ import annotations

import mlx.core as mx

from qfserve.kernels.backend import check_kernel_budget, kernel, resolve_kernel_mode
from qfserve.kernels.sources import APPLY, DEFAULT_THREADS, MAX_BUDGET

_INF = float("inf")


def protected_rows(L: int, n_sink: int, recent: int) -> mx.array:
    """``(L,)`` bool, True on the first ``n_sink`` and the last ``recent`` rows.

    Built in the graph each time (three small ops): a cache of them keyed by ``L`` kept one
    array per prompt length seen, memory the server never gave back."""
    rows = mx.arange(L)
    return (rows < n_sink) | (rows >= L - recent)


def rank_scores(scores: mx.array, n_sink: int, recent: int) -> mx.array:
    """The values rows are ranked by: NaN → -inf, then protected rows → +inf.

    Args:
        scores: ``(B, H, L)`` float32.
    Returns:
        ``(B, H, L)`` float32.
    """
    ranked = mx.where(mx.isnan(scores), -_INF, scores)
    return mx.where(protected_rows(scores.shape[-1], n_sink, recent), _INF, ranked)


def keep_threshold(ranked: mx.array, budget: int) -> mx.array:
    """The ``budget``-th largest value of each group.

    Args:
        ranked: ``(B, H, L)`` float32 from :func:`rank_scores`, ``L >= budget``.
    Returns:
        ``(B, H)`` float32.
    """
    kth = ranked.shape[-1] - budget
    return mx.partition(ranked, kth=kth, axis=-1)[..., kth]


def select_keep_reference(scores: mx.array, *, budget: int, n_sink: int, recent: int) -> mx.array:
    """Rows to keep, ascending, with the kernel's two-tier tie-break, in plain MLX.

    Args:
        scores: ``(B, H, L)`` float32, ``L >= budget``.
    Returns:
        ``(B, H, budget)`` uint32.
    """
    L = scores.shape[-1]
    ranked = rank_scores(scores, n_sink, recent)
    thresh = keep_threshold(ranked, budget)[..., None]  # (B, H, 1)
    above = ranked > thresh
    tied = ranked == thresh
    quota = budget - above.sum(axis=-1, keepdims=True)
    keep = above | (tied & (mx.cumsum(tied.astype(mx.int32), axis=-1) <= quota))
    rows = mx.arange(L, dtype=mx.uint32)
    # Kept rows sort first by their own index, dropped rows after (index + L).
    return mx.sort(mx.where(keep, rows, rows + L), axis=-1)[..., :budget]


def fused_evict_reference(
    keys: mx.array, values: mx.array, scores: mx.array, *, budget: int, n_sink: int, recent: int
) -> tuple[mx.array, mx.array, mx.array]:
    """The plain-MLX path of :func:`fused_evict` (same arguments, same result bit for bit)."""
    idx = select_keep_reference(scores, budget=budget, n_sink=n_sink, recent=recent)
    return (
        mx.take_along_axis(keys, idx[..., None], axis=2),
        mx.take_along_axis(values, idx[..., None], axis=2),
        mx.take_along_axis(scores, idx, axis=2),
    )


def fused_evict_kernel(
    keys: mx.array,
    values: mx.array,
    scores: mx.array,
    *,
    budget: int,
    n_sink: int,
    recent: int,
    threads: int = DEFAULT_THREADS,
) -> tuple[mx.array, mx.array, mx.array]:
    """The GPU path of :func:`fused_evict`: threshold in MLX, then one apply launch.

    Raises:
        ValueError: ``budget > MAX_BUDGET``.
        RuntimeError: no Metal or CUDA backend.
    """
    check_kernel_budget(budget)
    B, H, L, D = keys.shape
    Dv = values.shape[-1]
    thresh = keep_threshold(rank_scores(scores, n_sink, recent), budget)  # (B, H)
    params = mx.array([L, D, Dv, budget, n_sink, recent], dtype=mx.int32)
    out_keys, out_values, out_scores = kernel(APPLY)(
        inputs=[keys, values, scores, thresh, params],
        template=[
            ("T", keys.dtype),
            ("TV", values.dtype),
            ("TG", threads),
            ("MAX_BUDGET", MAX_BUDGET),
        ],
        grid=(B * H * threads, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, H, budget, D), (B, H, budget, Dv), (B, H, budget)],
        output_dtypes=[keys.dtype, values.dtype, mx.float32],
    )
    return out_keys, out_values, out_scores


def _check(
    keys: mx.array, values: mx.array, scores: mx.array, budget: int, n_sink: int, recent: int
) -> None:
    if keys.ndim != 4 or values.ndim != 4 or scores.ndim != 3:
        raise ValueError(
            "keys and values must be (B, H, L, D) and scores (B, H, L), got "
            f"{keys.shape}, {values.shape}, {scores.shape}"
        )
    if keys.shape[:3] != values.shape[:3] or keys.shape[:3] != scores.shape:
        raise ValueError(
            f"keys, values and scores must share (B, H, L), got {keys.shape}, {values.shape}, {scores.shape}"
        )
    if scores.dtype != mx.float32:
        raise ValueError(f"scores must be float32, got {scores.dtype}")
    L = keys.shape[2]
    if not 1 <= budget <= L:
        raise ValueError(f"budget must be in [1, L={L}], got {budget}")
    if n_sink < 0 or recent < 0:
        raise ValueError(f"n_sink and recent must be >= 0, got n_sink={n_sink}, recent={recent}")


def fused_evict(
    keys: mx.array,
    values: mx.array,
    scores: mx.array,
    *,
    budget: int,
    n_sink: int,
    recent: int,
    use_kernel: bool | None = None,
) -> tuple[mx.array, mx.array, mx.array]:
    """Keep the ``budget`` best rows of every (b, h) group, in temporal order.

    Rows are ranked by score with the first ``n_sink`` and the last ``recent`` rows forced in
    (+inf) and NaN ranked last. Exactly ``budget`` rows survive: among equal scores the lower
    position wins. Keys, values and scores of the survivors are returned unchanged (scores as
    stored, not as ranked). The kernel and the plain-MLX path give identical bits.

    Args:
        keys: ``(B, H, L, D)`` any float dtype.
        values: ``(B, H, L, Dv)`` any float dtype.
        scores: ``(B, H, L)`` float32, higher = keep.
        budget: Rows kept per group, ``1 <= budget <= L``.
        n_sink: Leading rows always kept (``>= 0``).
        recent: Trailing rows always kept (``>= 0``).
        use_kernel: ``None`` = the kernel where a backend exists and the budget fits
            (``resolve_kernel_mode("auto", budget)``); ``True`` = the kernel or an error;
            ``False`` = plain MLX.
    Returns:
        ``(keys, values, scores)`` of shapes ``(B, H, budget, D)``, ``(B, H, budget, Dv)``,
        ``(B, H, budget)``.
    Raises:
        ValueError: bad shapes or knobs; ``use_kernel=True`` with ``budget > MAX_BUDGET``.
        RuntimeError: ``use_kernel=True`` without a Metal or CUDA backend.
    """
    _check(keys, values, scores, budget, n_sink, recent)
    if use_kernel is None:
        use_kernel = resolve_kernel_mode("auto", budget)
    elif use_kernel:
        resolve_kernel_mode("on", budget)
    if use_kernel:
        return fused_evict_kernel(keys, values, scores, budget=budget, n_sink=n_sink, recent=recent)
    return fused_evict_reference(keys, values, scores, budget=budget, n_sink=n_sink, recent=recent)
