"""The plain-MLX path (the CPU path and the kernel's oracle) against the engine and the model."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from qfserve.engine.kv.evict import gather_rows, select_keep
from qfserve.engine.kv.scorers import project
from qfserve.kernels import fused_evict, qfilter_scores, use_backend
from qfserve.kernels.cpu_model import fused_evict_model
from qfserve.kernels.qfilters_apply import (
    fused_evict_reference,
    protected_rows,
    select_keep_reference,
)
from qfserve.kernels.qfilters_score import qfilter_scores_reference
from tests.kernels._reference import argsort_keep, make_scores

DTYPES = [mx.float16, mx.bfloat16, mx.float32]
_UINT = {2: mx.uint16, 4: mx.uint32}


def bits(x: mx.array) -> np.ndarray:
    """The raw bit pattern, so equality is bit-for-bit (and NaN == NaN)."""
    return np.array(x.view(_UINT[x.itemsize]))


def make_kv(rng, B, H, L, D, dtype):
    keys = mx.array(rng.standard_normal((B, H, L, D)).astype(np.float32)).astype(dtype)
    values = mx.array(rng.standard_normal((B, H, L, D + 2)).astype(np.float32)).astype(dtype)
    return keys, values


CASES = [
    # (B, H, L, budget, n_sink, recent, kind)
    (1, 1, 40, 10, 4, 0, "random"),
    (2, 3, 77, 30, 4, 8, "ties"),
    (2, 2, 64, 13, 4, 8, "constant"),
    (1, 4, 300, 100, 2, 30, "infinite"),
    (3, 2, 50, 49, 0, 0, "ties"),
    (2, 2, 33, 33, 1, 1, "random"),
    (4, 16, 20, 5, 0, 0, "random"),  # 64 groups
    (2, 2, 60, 20, 2, 4, "nan"),  # NaN ranked lowest on both sides
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, H, L, budget, n_sink, recent, kind", CASES)
def test_reference_equals_the_engine_bit_for_bit(dtype, B, H, L, budget, n_sink, recent, kind):
    rng = np.random.default_rng(L + budget)
    keys, values = make_kv(rng, B, H, L, 8, dtype)
    scores = mx.array(make_scores(rng, (B, H, L), kind))
    k, v, s = fused_evict_reference(
        keys, values, scores, budget=budget, n_sink=n_sink, recent=recent
    )
    idx = select_keep(scores, budget, n_sink, recent)
    assert np.array_equal(bits(k), bits(gather_rows(keys, idx)))
    assert np.array_equal(bits(v), bits(gather_rows(values, idx)))
    assert np.array_equal(bits(s), bits(gather_rows(scores, idx)))


@pytest.mark.parametrize("kind", ["random", "ties", "constant", "infinite", "nan"])
def test_reference_equals_the_kernel_model_and_the_oracle(kind):
    B, H, L, budget, n_sink, recent = 2, 3, 130, 45, 3, 7
    rng = np.random.default_rng(7)
    keys, values = make_kv(rng, B, H, L, 4, mx.float16)
    scores_np = make_scores(rng, (B, H, L), kind)
    scores = mx.array(scores_np)
    idx = select_keep_reference(scores, budget=budget, n_sink=n_sink, recent=recent)
    want = argsort_keep(scores_np.reshape(B * H, L), budget, n_sink, recent)
    np.testing.assert_array_equal(np.array(idx).reshape(B * H, budget), want)

    k, v, s = fused_evict_reference(
        keys, values, scores, budget=budget, n_sink=n_sink, recent=recent
    )
    mk, mv, ms = fused_evict_model(
        np.array(keys).reshape(B * H, L, 4),
        np.array(values).reshape(B * H, L, 6),
        scores_np.reshape(B * H, L),
        budget=budget,
        n_sink=n_sink,
        recent=recent,
    )
    assert np.array_equal(bits(k).reshape(mk.shape), mk.view(np.uint16))
    assert np.array_equal(bits(v).reshape(mv.shape), mv.view(np.uint16))
    assert np.array_equal(bits(s).reshape(ms.shape), ms.view(np.uint32))


def test_exactly_budget_rows_survive_when_everything_ties():
    keys, values = make_kv(np.random.default_rng(0), 1, 2, 50, 4, mx.float32)
    scores = mx.zeros((1, 2, 50))
    _, _, s = fused_evict(keys, values, scores, budget=12, n_sink=20, recent=20)
    assert s.shape == (1, 2, 12)
    idx = select_keep_reference(scores, budget=12, n_sink=20, recent=20)
    np.testing.assert_array_equal(np.array(idx)[0, 0], np.arange(12))


def test_stored_scores_are_returned_not_the_ranked_ones():
    # Protected rows rank at +inf but keep their stored score: they compete normally later.
    keys, values = make_kv(np.random.default_rng(0), 1, 1, 10, 4, mx.float32)
    scores = mx.arange(10, dtype=mx.float32)[None, None]
    _, _, s = fused_evict(keys, values, scores, budget=4, n_sink=1, recent=1)
    assert np.array(s).tolist() == [[[0.0, 7.0, 8.0, 9.0]]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("per_batch", [False, True])
def test_score_reference_equals_the_engine_scorer(dtype, sign, per_batch):
    B, H, L, D = 2, 3, 21, 16
    rng = np.random.default_rng(3)
    keys = mx.array(rng.standard_normal((B, H, L, D)).astype(np.float32)).astype(dtype)
    shape = (B, H, D) if per_batch else (H, D)
    filters = mx.array(rng.standard_normal(shape).astype(np.float32))
    got = qfilter_scores(keys, filters, sign=sign, n_sink=2, recent=3)
    want = mx.where(protected_rows(L, 2, 3), float("inf"), project(keys, filters, sign))
    assert np.array_equal(bits(got), bits(want))
    plain = qfilter_scores_reference(keys, filters, sign=sign)
    assert np.array_equal(bits(plain), bits(project(keys, filters, sign)))


def test_nan_scores_rank_last():
    keys = mx.array(np.full((1, 1, 4, 2), np.nan, dtype=np.float32))
    scores = qfilter_scores(keys, mx.ones((1, 2)))
    assert np.array(scores).tolist() == [[[-np.inf] * 4]]


def test_without_a_backend_fused_evict_runs_the_reference():
    keys, values = make_kv(np.random.default_rng(5), 1, 2, 30, 4, mx.float16)
    scores = mx.array(make_scores(np.random.default_rng(5), (1, 2, 30), "ties"))
    with use_backend(None):
        got = fused_evict(keys, values, scores, budget=9, n_sink=1, recent=2)
    want = fused_evict_reference(keys, values, scores, budget=9, n_sink=1, recent=2)
    for a, b in zip(got, want, strict=True):
        assert np.array_equal(bits(a), bits(b))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"budget": 0}, "budget must be in"),
        ({"budget": 31}, "budget must be in"),
        ({"n_sink": -1}, "n_sink and recent"),
        ({"recent": -2}, "n_sink and recent"),
    ],
)
def test_bad_knobs_raise_value_errors(kwargs, match):
    keys, values = make_kv(np.random.default_rng(0), 1, 1, 30, 4, mx.float32)
    args = {"budget": 8, "n_sink": 1, "recent": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        fused_evict(keys, values, mx.zeros((1, 1, 30)), **args)


def test_bad_shapes_and_dtypes_raise_value_errors():
    keys, values = make_kv(np.random.default_rng(0), 1, 1, 30, 4, mx.float32)
    with pytest.raises(ValueError, match="share"):
        fused_evict(keys, values[:, :, :20], mx.zeros((1, 1, 30)), budget=8, n_sink=1, recent=1)
    with pytest.raises(ValueError, match="float32"):
        fused_evict(keys, values, mx.zeros((1, 1, 30), mx.float16), budget=8, n_sink=1, recent=1)
    with pytest.raises(ValueError, match="filters must be"):
        qfilter_scores(keys, mx.zeros((2, 4)))
    with pytest.raises(ValueError, match="sign"):
        qfilter_scores(keys, mx.zeros((1, 4)), sign=0)
