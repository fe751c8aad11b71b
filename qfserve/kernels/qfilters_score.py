"""Dispatch 1, score: ``sign * (key . filter)`` for every stored row, in one launch.

Accumulates in float32 over float16 / bfloat16 / float32 keys; NaN scores become -inf and the
first ``n_sink`` / last ``recent`` rows +inf, as :func:`qfserve.kernels.qfilters_apply.rank_scores`
ranks them. The kernel (:data:`qfserve.kernels.sources.SCORE`) sums in a different order from MLX's
matmul, so its scores agree with the plain-MLX reference to float32 rounding, not bit for bit;
whichever path computed the stored scores, eviction from them is bit-identical across paths.
"""

from __future__ import annotations

import mlx.core as mx

from qfserve.kernels.backend import active_backend, kernel
from qfserve.kernels.qfilters_apply import rank_scores
from qfserve.kernels.sources import SCORE, SCORE_ROWS_PER_GROUP, SIMD_WIDTH


def _filters_for(keys: mx.array, filters: mx.array, sign: int) -> mx.array:
    if sign not in (1, -1):
        raise ValueError(f"sign must be +1 or -1, got {sign}")
    B, H, _, D = keys.shape
    if filters.shape not in ((H, D), (B, H, D)):
        raise ValueError(f"filters must be (H, D) or (B, H, D) = {(B, H, D)}, got {filters.shape}")
    f = filters.astype(mx.float32)
    # Negating first is exact, and is what qfserve.engine.kv.scorers.project does.
    return f if sign == 1 else -f


def qfilter_scores_reference(
    keys: mx.array, filters: mx.array, *, sign: int = 1, n_sink: int = 0, recent: int = 0
) -> mx.array:
    """The plain-MLX path of :func:`qfilter_scores` (same arguments and result)."""
    f = _filters_for(keys, filters, sign)
    scores = (keys.astype(mx.float32) @ f[..., None]).squeeze(-1)  # (B, H, L)
    return rank_scores(scores, n_sink, recent)


def qfilter_scores_kernel(
    keys: mx.array, filters: mx.array, *, sign: int = 1, n_sink: int = 0, recent: int = 0
) -> mx.array:
    """The GPU path of :func:`qfilter_scores`: one launch, one SIMD group per row."""
    B, H, L, D = keys.shape
    f = mx.broadcast_to(_filters_for(keys, filters, sign), (B, H, D))
    params = mx.array([L, D, n_sink, recent, B * H], dtype=mx.int32)
    threads = SCORE_ROWS_PER_GROUP * SIMD_WIDTH
    (scores,) = kernel(SCORE)(
        inputs=[keys, f, params],
        template=[("T", keys.dtype)],
        grid=(B * H * L * SIMD_WIDTH, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, H, L)],
        output_dtypes=[mx.float32],
    )
    return scores


def qfilter_scores(
    keys: mx.array,
    filters: mx.array,
    *,
    sign: int = 1,
    n_sink: int = 0,
    recent: int = 0,
    use_kernel: bool | None = None,
) -> mx.array:
    """Q-Filters scores of ``keys``: ``sign * (keys . filters)`` in float32, ranked for eviction.

    With ``n_sink = recent = 0`` these are the scores a cache stores at insertion; with them
    set, the protected rows come back as +inf, ready for a one-shot eviction.

    Args:
        keys: ``(B, H, L, D)`` float16, bfloat16 or float32.
        filters: ``(H, D)`` or ``(B, H, D)``.
        sign: ``+1`` (the paper's direction) or ``-1``.
        n_sink: Leading rows forced to +inf (``>= 0``), default 0.
        recent: Trailing rows forced to +inf (``>= 0``), default 0.
        use_kernel: ``None`` = the kernel where a backend exists; ``True`` = the kernel or a
            ``RuntimeError``; ``False`` = plain MLX.
    Returns:
        ``(B, H, L)`` float32; NaN products come back as -inf.
    """
    if keys.ndim != 4:
        raise ValueError(f"keys must be (B, H, L, D), got {keys.shape}")
    if n_sink < 0 or recent < 0:
        raise ValueError(f"n_sink and recent must be >= 0, got n_sink={n_sink}, recent={recent}")
    if use_kernel is None:
        use_kernel = active_backend() is not None
    if use_kernel:
        return qfilter_scores_kernel(keys, filters, sign=sign, n_sink=n_sink, recent=recent)
    return qfilter_scores_reference(keys, filters, sign=sign, n_sink=n_sink, recent=recent)
