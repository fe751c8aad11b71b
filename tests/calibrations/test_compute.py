"""The estimator on planted data: drift recovered with its sign, no centring, GQA averaging."""

from __future__ import annotations

import numpy as np
import pytest

from qfserve.calibrations.compute import (
    compute_filters,
    group_filters,
    head_filters,
    layer_filters,
    query_filter,
    query_scales,
)

D = 16


def _basis(rng: np.random.Generator) -> np.ndarray:
    """A random orthonormal basis (columns), so nothing is axis-aligned."""
    q, _ = np.linalg.qr(rng.standard_normal((D, D)))
    return q


def _planted(rng, drift_dir, spread_dir, *, drift=3.0, spread=1.5, n=3000) -> np.ndarray:
    """Queries = drift * drift_dir + noise, with the largest *centred* spread on spread_dir."""
    noise = 0.2 * rng.standard_normal((n, D))
    noise += np.outer(spread * rng.standard_normal(n), spread_dir)
    return drift * drift_dir + noise


def _centred_estimator(queries: np.ndarray) -> np.ndarray:
    """What the paper does *not* do: top right singular vector of the mean-centred sample."""
    _, _, vt = np.linalg.svd(queries - queries.mean(axis=0), full_matrices=False)
    return vt[0]


def test_recovers_planted_drift_with_its_sign():
    rng = np.random.default_rng(0)
    basis = _basis(rng)
    u, w = basis[:, 0], basis[:, 1]
    queries = _planted(rng, u, w)
    assert float(query_filter(queries) @ u) > 0.99
    # Negated drift: the raw SVD sign is arbitrary, the anchored filter follows the drift.
    assert float(query_filter(_planted(rng, -u, w)) @ u) < -0.99


def test_does_not_mean_centre():
    """The centred-variance axis (w) differs from the drift axis (u): only the uncentred
    estimator returns the drift; a centring estimator picks w on the same data."""
    rng = np.random.default_rng(1)
    basis = _basis(rng)
    u, w = basis[:, 2], basis[:, 5]
    queries = _planted(rng, u, w, drift=3.0, spread=1.5)
    centred = _centred_estimator(queries)
    assert abs(centred @ w) > 0.99 and abs(centred @ u) < 0.1  # the trap is real
    f = query_filter(queries)
    assert float(f @ u) > 0.99 and abs(float(f @ w)) < 0.1


def test_filter_is_unit_and_mean_projection_positive():
    rng = np.random.default_rng(2)
    queries = rng.standard_normal((500, D)) - 0.5  # drift along -1
    f = query_filter(queries)
    assert f.dtype == np.float32 and np.isclose(np.linalg.norm(f), 1.0, atol=1e-6)
    assert float((queries @ f).mean()) > 0
    assert float(f @ (-np.ones(D) / np.sqrt(D))) > 0.9


def test_head_filters_match_per_head_estimates():
    rng = np.random.default_rng(3)
    queries = rng.standard_normal((3, 200, D)) + rng.standard_normal((3, 1, D))
    np.testing.assert_allclose(
        head_filters(queries), np.stack([query_filter(q) for q in queries]), atol=1e-6
    )


def _reference_group(filters: np.ndarray, n_kv: int) -> np.ndarray:
    """Plain-loop reference of mlx-lm's GQA mapping: query head h -> KV head h // group."""
    n_heads = filters.shape[0]
    group = n_heads // n_kv
    out = np.zeros((n_kv, filters.shape[1]))
    for h in range(n_heads):
        out[h // group] += filters[h]
    return out / np.linalg.norm(out, axis=1, keepdims=True)


@pytest.mark.parametrize(("n_heads", "n_kv"), [(8, 2), (8, 8), (6, 1), (32, 8)])
def test_gqa_averaging_gives_unit_kv_filters(n_heads, n_kv):
    rng = np.random.default_rng(n_heads * 10 + n_kv)
    filters = rng.standard_normal((n_heads, D)) + 2.0  # heads roughly agree, as in a model
    filters /= np.linalg.norm(filters, axis=1, keepdims=True)
    grouped = group_filters(filters, n_kv)
    assert grouped.shape == (n_kv, D) and grouped.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(grouped, axis=1), 1.0, atol=1e-6)
    np.testing.assert_allclose(grouped, _reference_group(filters, n_kv), atol=1e-6)


def test_gqa_groups_are_contiguous_not_interleaved():
    # Heads 0,1 -> KV 0 and heads 2,3 -> KV 1 (h // 2), not h % 2.
    e = np.eye(D)
    filters = np.stack([e[0], e[0], e[1], e[1]])
    np.testing.assert_allclose(group_filters(filters, 2), np.stack([e[0], e[1]]), atol=1e-7)


def test_group_filters_rejects_bad_groups():
    with pytest.raises(ValueError, match="n_kv_heads must be >= 1 and divide.*got 3"):
        group_filters(np.ones((4, D)), 3)
    with pytest.raises(ValueError, match="cancel out"):
        group_filters(np.stack([np.eye(D)[0], -np.eye(D)[0]]), 1)


def test_layer_filters_and_summary():
    rng = np.random.default_rng(4)
    basis = _basis(rng)
    # KV head 0's query heads drift along u, KV head 1's along v.
    u, v, w = basis[:, 0], basis[:, 1], basis[:, 2]
    queries = np.stack([_planted(rng, d, w, n=400) for d in (u, u, v, v)])
    filters, summary = layer_filters(queries, 2)
    assert filters.shape == (2, D)
    assert float(filters[0] @ u) > 0.99 and float(filters[1] @ v) > 0.99
    assert summary["positive_share"] == 1.0
    assert 0.5 < summary["top_energy"] < 1.0
    assert summary["drift_ratio"] > 10


def test_opposite_heads_in_a_group_fall_back_to_pooled_queries():
    rng = np.random.default_rng(5)
    basis = _basis(rng)
    u, w = basis[:, 0], basis[:, 1]
    strong = _planted(rng, u, w, drift=3.0, spread=0.3, n=400)
    weak = _planted(rng, -u, w, drift=2.0, spread=0.3, n=400)
    assert np.linalg.norm(head_filters(np.stack([strong, weak])).mean(axis=0)) < 0.05
    filters, summary = layer_filters(np.stack([strong, weak]), 1)
    assert float(filters[0] @ u) > 0.9  # the pooled drift points along +u
    assert summary["positive_share"] == 0.5  # the weak head's sign was overruled


def test_compute_filters_stacks_layers():
    rng = np.random.default_rng(6)
    layers = [rng.standard_normal((4, 100, D)) + 1.0 for _ in range(3)]
    filters, summaries = compute_filters(layers, 2)
    assert filters.shape == (3, 2, D)
    assert [s["layer"] for s in summaries] == [0, 1, 2]
    np.testing.assert_allclose(filters[1], layer_filters(layers[1], 2)[0])


@pytest.mark.parametrize("bad", [np.zeros((0, D)), np.full((4, D), np.nan), np.ones(D)])
def test_query_filter_rejects_bad_input(bad):
    with pytest.raises(ValueError, match="queries"):
        query_filter(bad)


def test_query_scale_is_the_group_mean_projection_on_the_kv_filter():
    """E<q, f> per KV head: planted drifts of 3 and 1 on two groups, each the mean over both
    query heads of the group, computed against a plain numpy mean."""
    rng = np.random.default_rng(5)
    basis = _basis(rng)
    heads = [
        _planted(rng, basis[:, 0], basis[:, 1], drift=d, spread=0.5, n=2000)
        for d in (3.0, 3.0, 1.0, 1.0)
    ]
    queries = np.stack(heads)  # (4, N, D): query heads 0, 1 -> KV 0; 2, 3 -> KV 1
    filters, _ = compute_filters([queries, -queries], n_kv_heads=2)
    scale = query_scales([queries, -queries], filters)
    assert scale.shape == (2, 2) and scale.dtype == np.float32
    for layer, q in enumerate((queries, -queries)):
        for k in range(2):
            pooled = q[2 * k : 2 * k + 2].reshape(-1, D)
            np.testing.assert_allclose(
                scale[layer, k], (pooled @ filters[layer, k]).mean(), rtol=1e-5
            )
    np.testing.assert_allclose(scale[:, 0], 3.0, rtol=0.05)  # sign anchoring: positive
    np.testing.assert_allclose(scale[:, 1], 1.0, rtol=0.1)
    with pytest.raises(ValueError, match="must hold 2 layers"):
        query_scales([queries], filters)
