"""The fused decode ops (``decode_block.cpp``) against numpy in float64 on the dequantized
codes: Llama's block, and the extras Qwen3 and Gemma 3 add (per-head q/k norms, post norms,
the ``gelu_approx(gate) * up`` MLP) with gate values across tanh's whole range."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from tests.kernels.conftest import activations

K, F, HQ, HKV, D = 64, 96, 4, 2, 16
EPS = 1e-6


def quantized(rng, n: int, k: int) -> tuple[list[mx.array], np.ndarray]:
    """Codes (w, float32 scales, biases) of a random (n, k) weight and what they decode to."""
    w, s, b = mx.quantize(mx.array(rng.standard_normal((n, k)).astype(np.float32)), 32, 4)
    codes = [w, s.astype(mx.float32), b.astype(mx.float32)]
    return codes, np.array(mx.dequantize(*codes, group_size=32, bits=4)).astype(np.float64)


def rms(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + EPS) * w


def gelu_approx(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def rope(x: np.ndarray, position: int, base: float = 10000.0) -> np.ndarray:
    half = D // 2
    theta = position * base ** (-np.arange(half) / half)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate(
        [x1 * np.cos(theta) - x2 * np.sin(theta), x1 * np.sin(theta) + x2 * np.cos(theta)], -1
    )


@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma3"])
def test_decode_tail_matches_float64(kernel, gemma):
    rng = np.random.default_rng(7 + gemma)
    (o, Ow), (gate, G), (up, U), (down, Dn) = (
        quantized(rng, n, k) for n, k in ((K, HQ * D), (F, K), (F, K), (K, F))
    )
    a = rng.standard_normal((2, HQ, 1, D)).astype(np.float32)
    x = rng.standard_normal((2, 1, K)).astype(np.float32)
    # A large norm weight drives the gate across gelu's range (tanh's saturated ends too).
    norm = rng.uniform(2.0, 6.0, K).astype(np.float32)
    posts = [rng.uniform(0.5, 1.5, K).astype(np.float32) for _ in range(2)] if gemma else None
    with activations(kernel, 0):  # float32 products: the reference's arithmetic but rounding
        got = kernel.decode_tail(
            mx.array(a),
            mx.array(x),
            o,
            mx.array(norm),
            EPS,
            gate,
            up,
            down,
            post_attention=None if posts is None else mx.array(posts[0]),
            post_feedforward=None if posts is None else mx.array(posts[1]),
            activation="gelu_approx" if gemma else "swiglu",
        )
        got = np.array(got)
    r = a.astype(np.float64).reshape(2, 1, HQ * D) @ Ow.T
    h = x + (rms(r, posts[0]) if posts else r)
    n = rms(h, norm)
    g, u = n @ G.T, n @ U.T
    assert g.min() < -6 and g.max() > 6  # both of tanh's tails are met
    act = gelu_approx(g) * u if gemma else g / (1 + np.exp(-g)) * u
    m = act @ Dn.T
    want = h + (rms(m, posts[1]) if posts else m)
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-5 * np.abs(want).max())


def test_decode_qkv_head_norms_match_float64(kernel):
    rng = np.random.default_rng(3)
    (q, Q), (k, Kw), (v, V) = (quantized(rng, n, K) for n in (HQ * D, HKV * D, HKV * D))
    x = rng.standard_normal((1, 1, K)).astype(np.float32)
    norm = rng.uniform(0.5, 1.5, K).astype(np.float32)
    qn, kn = (rng.uniform(0.5, 1.5, D).astype(np.float32) for _ in range(2))
    half = D // 2
    inv = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * (math.log(10000.0) / half))
    with activations(kernel, 0):
        got = kernel.decode_qkv(
            mx.array(x),
            q,
            k,
            v,
            inv,
            mx.array(37, dtype=mx.int32),
            HQ,
            HKV,
            D,
            norm=mx.array(norm),
            eps=EPS,
            head_norms=[mx.array(qn), mx.array(kn)],
        )
        got = [np.array(t) for t in got]
    n = rms(x.astype(np.float64), norm)[0, 0]
    want_q = rope(rms((Q @ n).reshape(HQ, D), qn), 37)
    want_k = rope(rms((Kw @ n).reshape(HKV, D), kn), 37)
    for g, w in ((got[0], want_q), (got[1], want_k), (got[2], (V @ n).reshape(HKV, D))):
        np.testing.assert_allclose(g[0, :, 0], w, rtol=0, atol=1e-5 * np.abs(w).max())


def test_decode_tail_refuses_an_unknown_activation(kernel):
    rng = np.random.default_rng(0)
    codes = [quantized(rng, n, k)[0] for n, k in ((K, HQ * D), (F, K), (F, K), (K, F))]
    a, x = mx.zeros((1, HQ, 1, D)), mx.zeros((1, 1, K))
    with pytest.raises(ValueError, match="activation"):
        kernel.decode_tail(a, x, codes[0], mx.ones(K), EPS, *codes[1:], activation="relu")
