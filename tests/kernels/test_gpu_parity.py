"""The kernels on a real GPU (Metal or MLX's CUDA backend) against the plain-MLX path.

Skipped, with the reason shown, where MLX has no GPU backend. The reference side of every
comparison is the same code the other tests run on the CPU.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from qfserve.kernels import MAX_BUDGET, active_backend
from qfserve.kernels.qfilters_apply import fused_evict_kernel, fused_evict_reference
from qfserve.kernels.qfilters_score import qfilter_scores_kernel, qfilter_scores_reference
from tests.kernels._reference import KINDS, make_scores

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        active_backend() is None, reason="no Metal or CUDA backend for MLX on this machine"
    ),
]

DTYPES = [mx.float16, mx.bfloat16, mx.float32]
_UINT = {2: mx.uint16, 4: mx.uint32}


def bits(x: mx.array) -> np.ndarray:
    return np.array(x.view(_UINT[x.itemsize]))


def inputs(B, H, L, D, dtype, kind, seed=0):
    rng = np.random.default_rng(seed)
    keys = mx.array(rng.standard_normal((B, H, L, D)).astype(np.float32)).astype(dtype)
    values = mx.array(rng.standard_normal((B, H, L, D)).astype(np.float32)).astype(dtype)
    return keys, values, mx.array(make_scores(rng, (B, H, L), kind))


def assert_same_bits(got, want):
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert np.array_equal(bits(a), bits(b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "B, H, L, budget, n_sink, recent",
    [
        (1, 8, 1000, 256, 4, 32),  # L not a multiple of the threadgroup
        (2, 32, 300, 100, 4, 0),  # 64 groups
        (1, 2, 513, 513, 1, 1),  # budget = rows
        (1, 4, 700, 41, 8, 32),  # budget = n_sink + recent + 1
        (1, 2, 64, 16, 40, 40),  # every row protected
    ],
)
def test_apply_kernel_matches_the_plain_path_bit_for_bit(
    dtype, kind, B, H, L, budget, n_sink, recent
):
    keys, values, scores = inputs(B, H, L, 64, dtype, kind)
    args = {"budget": budget, "n_sink": n_sink, "recent": recent}
    assert_same_bits(
        fused_evict_kernel(keys, values, scores, **args),
        fused_evict_reference(keys, values, scores, **args),
    )


def test_apply_kernel_at_the_max_budget():
    keys, values, scores = inputs(1, 2, MAX_BUDGET + 300, 16, mx.float16, "ties")
    args = {"budget": MAX_BUDGET, "n_sink": 4, "recent": 64}
    assert_same_bits(
        fused_evict_kernel(keys, values, scores, **args),
        fused_evict_reference(keys, values, scores, **args),
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [64, 80, 128])
def test_score_kernel_matches_the_plain_path(dtype, D):
    keys, _, _ = inputs(2, 4, 333, D, dtype, "random")
    filters = mx.array(np.random.default_rng(1).standard_normal((4, D)).astype(np.float32))
    for sign in (1, -1):
        got = qfilter_scores_kernel(keys, filters, sign=sign, n_sink=3, recent=5)
        want = qfilter_scores_reference(keys, filters, sign=sign, n_sink=3, recent=5)
        # Summation order differs from MLX's matmul: equal to float32 rounding, not bits.
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-4 * D)
        assert np.isinf(np.array(got)[..., :3]).all() and np.isinf(np.array(got)[..., -5:]).all()


def test_score_kernel_ranks_nan_last():
    keys = mx.full((1, 1, 5, 32), float("nan"), dtype=mx.float16)
    got = qfilter_scores_kernel(keys, mx.ones((1, 32)), sign=1)
    assert np.array(got).tolist() == [[[-np.inf] * 5]]


def test_score_then_evict_is_interchangeable_with_the_plain_path():
    keys, values, _ = inputs(1, 8, 2000, 128, mx.float16, "random")
    filters = mx.array(np.random.default_rng(2).standard_normal((8, 128)).astype(np.float32))
    scores = qfilter_scores_kernel(keys, filters)
    args = {"budget": 512, "n_sink": 4, "recent": 64}
    assert_same_bits(
        fused_evict_kernel(keys, values, scores, **args),
        fused_evict_reference(keys, values, scores, **args),
    )
