"""Q-Filters from sampled queries: the paper's uncentred SVD, sign anchoring and GQA averaging.

For a head with sampled queries ``Q`` ``(N, D)`` and SVD ``Q = U S V^T`` (paper Eq. 1), the
filter is ``v1+ = sgn(1^T u1) v1``. Two details matter:

* **No mean-centring.** The filter is the direction the query cloud has drifted to away from
  the origin (Observation 3.1). Centring removes exactly that drift and returns the axis of
  largest spread instead, a different direction.
* **Sign anchoring.** ``1^T u1 = N * mean(Q v1) / s1``, so the sign makes the mean query
  project positively on the filter; then keys with a larger projection receive more
  attention on average and "higher projection = keep" is the right ranking.

Under grouped-query attention mlx-lm maps query head ``h`` to KV head
``h // (n_heads // n_kv_heads)``; the filters of each group are averaged onto their KV head
and renormalised.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

_EPS = 1e-8
# A group mean of unit filters shorter than this means its heads point (nearly) opposite ways.
_CANCEL_TOL = 0.05


def _check_queries(queries: np.ndarray, ndim: int, name: str) -> np.ndarray:
    queries = np.asarray(queries)
    if queries.ndim != ndim or 0 in queries.shape:
        shape = "(N, D)" if ndim == 2 else "(H, N, D)"
        raise ValueError(f"{name} must be a non-empty {shape} array, got shape {queries.shape}")
    if not np.isfinite(queries).all():
        raise ValueError(f"{name} contains non-finite values (NaN or inf)")
    return queries.astype(np.float64)


def _signed_svd(queries: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(v1+ (D,), singular values (k,), mean projections on each right vector (k,))``."""
    u, s, vt = np.linalg.svd(queries, full_matrices=False)  # uncentred on purpose
    sign = 1.0 if u[:, 0].sum() >= 0 else -1.0
    mean_proj = s * u.mean(axis=0)  # mean(Q @ v_i) for every right singular vector
    return sign * vt[0], s, sign * mean_proj


def query_filter(queries: np.ndarray) -> np.ndarray:
    """The Q-Filter of one head: the sign-anchored top right singular vector.

    Args:
        queries: ``(N, D)`` sampled post-RoPE queries of one head (not centred).
    Returns:
        ``(D,)`` float32 unit vector with a non-negative mean query projection.
    Raises:
        ValueError: wrong shape or non-finite values.
    """
    q = _check_queries(queries, 2, "queries")
    return _signed_svd(q)[0].astype(np.float32)


def head_filters(queries: np.ndarray) -> np.ndarray:
    """Q-Filters of every query head of a layer.

    Args:
        queries: ``(H, N, D)`` sampled queries.
    Returns:
        ``(H, D)`` float32 unit filters.
    """
    q = _check_queries(queries, 3, "queries")
    return np.stack([_signed_svd(head)[0] for head in q]).astype(np.float32)


def _check_groups(n_heads: int, n_kv_heads: int) -> int:
    if n_kv_heads < 1 or n_heads % n_kv_heads:
        raise ValueError(
            f"n_kv_heads must be >= 1 and divide the number of query heads ({n_heads}), "
            f"got {n_kv_heads}"
        )
    return n_heads // n_kv_heads


def _group_mean(filters: np.ndarray, n_kv_heads: int) -> np.ndarray:
    group = _check_groups(filters.shape[0], n_kv_heads)
    # Query heads [k * group, (k + 1) * group) share KV head k: h // group == k.
    return filters.reshape(n_kv_heads, group, -1).mean(axis=1)  # (KV, D)


def group_filters(filters: np.ndarray, n_kv_heads: int) -> np.ndarray:
    """Average query-head filters onto their KV heads and renormalise.

    Args:
        filters: ``(H, D)`` per-query-head filters.
        n_kv_heads: KV heads; must divide H. Query head h belongs to KV head
            ``h // (H // n_kv_heads)``.
    Returns:
        ``(n_kv_heads, D)`` float32 unit filters.
    Raises:
        ValueError: ``n_kv_heads`` does not divide H, or a group's filters cancel out.
    """
    filters = np.asarray(filters, dtype=np.float64)
    if filters.ndim != 2:
        raise ValueError(f"filters must have shape (H, D), got {filters.shape}")
    mean = _group_mean(filters, n_kv_heads)
    norms = np.linalg.norm(mean, axis=-1, keepdims=True)
    if (norms < _CANCEL_TOL).any():
        bad = np.flatnonzero(norms[:, 0] < _CANCEL_TOL).tolist()
        raise ValueError(f"the query-head filters of KV heads {bad} cancel out (mean ~ 0)")
    return (mean / norms).astype(np.float32)


def layer_filters(queries: np.ndarray, n_kv_heads: int) -> tuple[np.ndarray, dict[str, float]]:
    """KV-head filters of one layer and its anisotropy summary.

    A group whose query-head filters (nearly) cancel out, i.e. whose heads drift in opposite
    directions so that their mean is no direction at all, takes the filter of the group's
    pooled queries instead.

    Args:
        queries: ``(H, N, D)`` sampled post-RoPE queries.
        n_kv_heads: KV heads of the layer.
    Returns:
        ``(n_kv_heads, D)`` float32 unit filters, and a summary with

        * ``positive_share``: share of query heads whose mean query projects positively on
          the filter of their KV head (1.0 means averaging kept every head's sign);
        * ``top_energy``: mean over heads of ``s1^2 / sum(s^2)``, the share of the queries'
          (uncentred) energy along the filter;
        * ``drift_ratio``: median over heads of ``|mean(Q v1)|`` over the mean of
          ``|mean(Q v_i)|``, i > 1: how much the drift is concentrated on the filter.
    """
    q = _check_queries(queries, 3, "queries")
    n_heads, _, dim = q.shape
    group = _check_groups(n_heads, n_kv_heads)
    per_head, energy, ratio = [], [], []
    for head in q:
        v1, s, mean_proj = _signed_svd(head)
        per_head.append(v1)
        energy.append(s[0] ** 2 / max((s**2).sum(), _EPS))
        rest = np.abs(mean_proj[1:]).mean() if len(mean_proj) > 1 else 0.0
        ratio.append(abs(mean_proj[0]) / max(rest, _EPS))
    mean = _group_mean(np.stack(per_head), n_kv_heads)  # (KV, D)
    for k in np.flatnonzero(np.linalg.norm(mean, axis=-1) < _CANCEL_TOL):
        pooled = q[k * group : (k + 1) * group].reshape(-1, dim)
        mean[k] = _signed_svd(pooled)[0]
    filters = mean / np.linalg.norm(mean, axis=-1, keepdims=True)
    kv_of_head = np.arange(n_heads) // group
    head_means = q.mean(axis=1)  # (H, D)
    positive = (np.einsum("hd,hd->h", head_means, filters[kv_of_head]) > 0).mean()
    summary = {
        "positive_share": float(positive),
        "top_energy": float(np.mean(energy)),
        "drift_ratio": float(np.median(ratio)),
    }
    return filters.astype(np.float32), summary


def query_scales(queries_per_layer: Sequence[np.ndarray], filters: np.ndarray) -> np.ndarray:
    """``E<q, f>``: each KV head's mean query projection on its filter, over its GQA group.

    A key's expected attention logit is about ``E<q, f> * (f . k) / sqrt(D)``, so this scale
    makes projections comparable across heads (filter norms are 1, query scales are not).

    Args:
        queries_per_layer: one ``(H, N, D)`` array per layer (the calibration's queries).
        filters: ``(n_layers, n_kv_heads, D)`` their filters.
    Returns:
        ``(n_layers, n_kv_heads)`` float32; positive where the sign anchoring held.
    """
    n_layers, n_kv_heads, _ = filters.shape
    if len(queries_per_layer) != n_layers:
        raise ValueError(
            f"queries_per_layer must hold {n_layers} layers (one per filter layer), "
            f"got {len(queries_per_layer)}"
        )
    out = np.empty((n_layers, n_kv_heads), dtype=np.float64)
    for i, queries in enumerate(queries_per_layer):
        q = _check_queries(queries, 3, f"queries of layer {i}")
        group = _check_groups(q.shape[0], n_kv_heads)
        for k in range(n_kv_heads):
            pooled = q[k * group : (k + 1) * group].reshape(-1, q.shape[-1])
            out[i, k] = (pooled @ filters[i, k].astype(np.float64)).mean()
    return out.astype(np.float32)


def compute_filters(
    queries_per_layer: Sequence[np.ndarray], n_kv_heads: int
) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """Q-Filters of a whole model from each layer's sampled queries.

    Args:
        queries_per_layer: one ``(H, N, D)`` array per layer.
        n_kv_heads: KV heads per layer.
    Returns:
        ``(n_layers, n_kv_heads, D)`` float32 unit filters, and one summary per layer
        (see :func:`layer_filters`) with its ``layer`` index.
    Raises:
        ValueError: no layers, or any layer's queries are invalid.
    """
    if len(queries_per_layer) == 0:
        raise ValueError("queries_per_layer must hold at least one layer, got 0")
    filters, summaries = [], []
    for i, queries in enumerate(queries_per_layer):
        f, summary = layer_filters(queries, n_kv_heads)
        filters.append(f)
        summaries.append({"layer": i, **summary})
    return np.stack(filters), summaries
