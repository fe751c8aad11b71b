"""The native RoPE, RMS norm, SwiGLU, GELU-gated product and log-softmax against numpy (float64),
and against MLX's own ops on the shapes and strides a model hands them."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.activations import swiglu


def rope_reference(x, dims, traditional, base, scale, offsets):
    """RoPE in float64: positions (t + offset[b]) * scale, frequencies base^(-2i/dims)."""
    B, H, T, D = x.shape
    half = dims // 2
    inv = base ** (-np.arange(half) / half)
    out = x.astype(np.float64).copy()
    for b in range(B):
        theta = ((np.arange(T) + offsets[b]) * scale)[:, None] * inv[None]  # (T, half)
        cos, sin = np.cos(theta), np.sin(theta)
        idx1 = np.arange(0, dims, 2) if traditional else np.arange(half)
        idx2 = idx1 + (1 if traditional else half)
        x1, x2 = x[b][..., idx1].astype(np.float64), x[b][..., idx2].astype(np.float64)
        out[b][..., idx1] = x1 * cos - x2 * sin  # (H, T, half) against (T, half)
        out[b][..., idx2] = x1 * sin + x2 * cos
    return out


def inv_freqs(dims, base):
    half = dims // 2
    return mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * (math.log(base) / half))


@pytest.mark.parametrize(
    ("shape", "dims", "traditional", "scale", "offsets"),
    [
        ((1, 9, 1, 64), 64, False, 1.0, [4095]),  # a decode step's query
        ((1, 3, 70, 64), 64, False, 1.0, [100]),  # a prompt block's keys
        ((2, 4, 5, 32), 16, True, 0.5, [3, 900]),  # a batch, partial rotary, traditional
    ],
)
def test_rope_matches_numpy_and_mlx(kernel, shape, dims, traditional, scale, offsets):
    x = np.random.default_rng(len(offsets) + dims).standard_normal(shape, dtype=np.float32)
    offset = mx.array(offsets if len(offsets) > 1 else offsets[0], dtype=mx.int32)
    got = kernel.rope(mx.array(x), inv_freqs(dims, 10000.0), offset, dims,
                      traditional=traditional, scale=scale)  # fmt: skip
    want = rope_reference(x, dims, traditional, 10000.0, scale, offsets * shape[0])
    np.testing.assert_allclose(np.array(got), want, atol=2e-3)  # float32 angles up to ~4k rad
    theirs = mx.fast.rope(mx.array(x), dims, traditional=traditional, base=10000.0,
                          scale=scale, offset=offset)  # fmt: skip
    np.testing.assert_allclose(np.array(got), np.array(theirs), atol=1e-5)


def test_rope_reads_strided_inputs_and_refuses_bad_ones(kernel):
    x = np.random.default_rng(1).standard_normal((1, 6, 4, 64), dtype=np.float32)
    strided = mx.array(x).transpose(0, 2, 1, 3).transpose(0, 2, 1, 3)[:, ::2]  # every other head
    offset = mx.array(7, dtype=mx.int32)
    got = kernel.rope(strided, inv_freqs(64, 1e4), offset, 64)
    want = mx.fast.rope(strided, 64, traditional=False, base=1e4, scale=1.0, offset=7)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5)
    with pytest.raises(ValueError, match="even"):
        kernel.rope(mx.array(x), inv_freqs(64, 1e4), offset, 63)
    with pytest.raises(ValueError, match="dims / 2"):
        kernel.rope(mx.array(x), inv_freqs(32, 1e4), offset, 64)
    with pytest.raises(ValueError, match="offset"):
        kernel.rope(mx.array(x), inv_freqs(64, 1e4), mx.array([1, 2, 3], dtype=mx.int32), 64)


@pytest.mark.parametrize("shape", [(1, 1, 576), (2, 37, 576), (3, 5)])
def test_rms_norm_matches_numpy(kernel, shape):
    rng = np.random.default_rng(shape[-1])
    x = rng.standard_normal(shape, dtype=np.float32) * 3
    w = rng.standard_normal(shape[-1:], dtype=np.float32)
    got = kernel.rms_norm(mx.array(x), mx.array(w), 1e-5)
    x64 = x.astype(np.float64)
    want = x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-5) * w
    np.testing.assert_allclose(np.array(got), want, rtol=1e-5, atol=1e-5)
    transposed = mx.array(np.ascontiguousarray(np.swapaxes(x, 0, -1))).swapaxes(0, -1)
    got_t = kernel.rms_norm(transposed, mx.array(w), 1e-5)  # rows read through strides
    np.testing.assert_allclose(np.array(got_t), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 1, 1536), (1, 50, 1536), (4, 7)])
def test_swiglu_matches_numpy_and_mlx_lm(kernel, shape):
    rng = np.random.default_rng(shape[-1] + shape[0])
    g = rng.standard_normal(shape, dtype=np.float32) * 30  # exp's range, both tails
    u = rng.standard_normal(shape, dtype=np.float32)
    got = np.array(kernel.swiglu(mx.array(g), mx.array(u)))
    g64 = g.astype(np.float64)
    np.testing.assert_allclose(got, g64 / (1 + np.exp(-g64)) * u, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got, np.array(swiglu(mx.array(g), mx.array(u))), rtol=1e-5,
                               atol=1e-6)  # fmt: skip
    with pytest.raises(ValueError, match="same shape"):
        kernel.swiglu(mx.array(g), mx.array(u[..., :1]))


@pytest.mark.parametrize("shape", [(1, 1, 2048), (1, 50, 2048), (4, 7)])
def test_gelu_glu_matches_numpy_and_mlx(kernel, shape):
    """Gemma's MLP activation: gelu_approx(g) * u, tanh's saturated tails included."""
    import mlx.nn as nn

    rng = np.random.default_rng(shape[-1] + shape[0])
    g = rng.standard_normal(shape, dtype=np.float32) * 8
    u = rng.standard_normal(shape, dtype=np.float32)
    got = np.array(kernel.gelu_glu(mx.array(g), mx.array(u)))
    g64 = g.astype(np.float64)
    t = np.tanh(math.sqrt(2 / math.pi) * (g64 + 0.044715 * g64**3))
    np.testing.assert_allclose(got, 0.5 * g64 * (1 + t) * u, rtol=1e-5, atol=1e-6)
    mlx_own = np.array(nn.gelu_approx(mx.array(g)) * mx.array(u))
    np.testing.assert_allclose(got, mlx_own, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="same shape"):
        kernel.gelu_glu(mx.array(g), mx.array(u[..., :1]))


@pytest.mark.parametrize("shape", [(1, 49152), (3, 1000), (2, 2, 37), (1, 5)])
def test_log_softmax_matches_numpy_and_mlx(kernel, shape):
    """A step's log-probabilities and greedy draw: against float64 numpy and MLX's own
    ``x - logsumexp(x)`` / ``argmax``; masked (-inf) entries, ties on the largest (the first
    wins, in any lane), rows shorter than a vector, a strided row."""
    rng = np.random.default_rng(shape[-1])
    x = (rng.standard_normal(shape) * 6).astype(np.float32)
    flat = x.reshape(-1, shape[-1])
    flat[:, ::3] = -np.inf  # a grammar's or logit bias's masked tokens
    if shape[-1] > 20:
        flat[0, [7, 20]] = 50.0  # a tie, in two lanes: the first index wins
    got, best = kernel.log_softmax(mx.array(x))
    x64 = x.astype(np.float64)
    top = x64.max(-1, keepdims=True)
    want = x64 - (top + np.log(np.exp(x64 - top).sum(-1, keepdims=True)))
    np.testing.assert_allclose(np.array(got), want, rtol=1e-6, atol=1e-5)
    assert best.dtype == mx.uint32 and best.shape == tuple(shape[:-1])
    mlx_own = mx.array(x) - mx.logsumexp(mx.array(x), axis=-1, keepdims=True)
    np.testing.assert_array_equal(np.array(best), np.array(mx.argmax(mlx_own, axis=-1)))
    if shape[-1] > 20:
        assert int(np.array(best).reshape(-1)[0]) == 7
    strided = mx.array(np.ascontiguousarray(flat.T)).T  # each row's entries a column apart
    got = np.array(kernel.log_softmax(strided)[0])
    np.testing.assert_allclose(got, want.reshape(flat.shape), rtol=1e-6, atol=1e-5)


def test_log_softmax_edge_rows_as_mlx(kernel):
    """Rows MLX answers with NaN: all masked, a +inf logit, a NaN; the argmax is MLX's too
    (the first NaN)."""
    inf, nan = np.inf, np.nan
    rows = [[-inf] * 20, [inf, 0.0] * 10, [1.0] * 19 + [nan], [1.0, inf] * 10, [-inf] * 19 + [3.0]]
    x = mx.array(np.array(rows, dtype=np.float32))
    got, best = kernel.log_softmax(x)
    mlx_own = x - mx.logsumexp(x, axis=-1, keepdims=True)
    np.testing.assert_array_equal(np.array(got), np.array(mlx_own))  # NaN where MLX's are
    np.testing.assert_array_equal(np.array(best), np.array(mx.argmax(mlx_own, axis=-1)))
    with pytest.raises(ValueError, match="float32"):
        kernel.log_softmax(x.astype(mx.float16))
