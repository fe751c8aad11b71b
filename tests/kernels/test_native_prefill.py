"""The native prefill attention against a float64 numpy softmax (causal blocks over longer
keys, grouped queries, key masks, any strides, sliding windows), and its KVzip scores against numpy's max of a
softmax restricted to the counted keys."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest


def reference(q, k, v, scale, key_mask=None, counted=None, window=0):
    """(out, scores) in float64: query i at key position S - N + i sees keys up to it (and,
    with a window, none a window or more before it)."""
    B, Hq, N, _ = q.shape
    H, S = k.shape[1], k.shape[2]
    group = Hq // H
    own = (S - N + np.arange(N))[:, None]
    visible = np.arange(S)[None] <= own  # (N, S)
    if window:
        visible &= np.arange(S)[None] > own - window
    out = np.zeros((B, Hq, N, v.shape[-1]))
    scores = np.zeros((B, H, S))
    for b in range(B):
        for hq in range(Hq):
            h = hq // group
            allowed = visible if key_mask is None else visible & key_mask[b, h][None]
            logits = q[b, hq].astype(np.float64) @ k[b, h].T.astype(np.float64) * scale
            logits = np.where(allowed, logits, -np.inf)
            top = logits.max(-1, keepdims=True)
            e = np.where(allowed, np.exp(logits - np.where(np.isfinite(top), top, 0.0)), 0.0)
            total = e.sum(-1, keepdims=True)
            out[b, hq] = np.divide(e @ v[b, h], total, out=np.zeros_like(out[b, hq]),
                                   where=total > 0)  # fmt: skip
            if counted is not None:
                c = e * counted[b, h][None]
                kept = c.sum(-1, keepdims=True)
                w = np.divide(c, kept, out=np.zeros_like(c), where=kept > 0)
                scores[b, h] = np.maximum(scores[b, h], w.max(0))
    return out, scores


def _inputs(rng, B, Hq, H, N, S, D, Dv=None):
    q = rng.standard_normal((B, Hq, N, D), dtype=np.float32)
    k = rng.standard_normal((B, H, S, D), dtype=np.float32) * 1.5
    v = rng.standard_normal((B, H, S, Dv or D), dtype=np.float32)
    return q, k, v


SHAPES = [  # (B, Hq, H, N, S, D, Dv): SmolLM2's heads, blocks shorter than a tile, odd dims
    (1, 9, 3, 130, 300, 64, 64),
    (1, 9, 3, 512, 512, 64, 64),
    (2, 4, 2, 70, 70, 8, 8),
    (1, 3, 3, 1, 5, 16, 24),
    (2, 6, 2, 33, 200, 40, 40),
]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("masked", [False, True])
def test_prefill_attention_matches_numpy(kernel, shape, masked):
    B, Hq, H, N, S, D, Dv = shape
    rng = np.random.default_rng(N + S + masked)
    q, k, v = _inputs(rng, B, Hq, H, N, S, D, Dv)
    key_mask = rng.random((B, H, S)) > 0.3 if masked else None
    got = kernel.prefill_attention(
        mx.array(q), mx.array(k), mx.array(v), 0.3,
        key_mask=None if key_mask is None else mx.array(key_mask),
    )  # fmt: skip
    want, _ = reference(q, k, v, 0.3, key_mask)
    assert got.shape == (B, Hq, N, Dv)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize(
    ("shape", "window"),
    [
        ((1, 4, 1, 512, 1023, 256, 256), 512),  # Gemma 3's local layers, a chunk past the window
        ((2, 6, 2, 70, 200, 40, 40), 37),  # a window that is no multiple of a key block
        ((1, 9, 3, 130, 300, 64, 64), 1),  # each query its own key only
        ((1, 3, 3, 20, 20, 16, 24), 64),  # a window wider than the keys: causal
    ],
)
@pytest.mark.parametrize("masked", [False, True])
def test_a_sliding_window_matches_numpy_and_mlx(kernel, shape, window, masked):
    """A sliding-window layer's prompt block against numpy and against MLX's attention under
    mlx-lm's own window mask (what the layer would run without the kernel)."""
    from mlx_lm.models.base import create_causal_mask

    B, Hq, H, N, S, D, Dv = shape
    rng = np.random.default_rng(window + N)
    q, k, v = _inputs(rng, B, Hq, H, N, S, D, Dv)
    mask = rng.random((B, H, S)) > 0.2 if masked else None
    scale = D**-0.5
    args = (mx.array(q), mx.array(k), mx.array(v), scale)
    got = kernel.prefill_attention(
        *args, key_mask=None if mask is None else mx.array(mask), window=window
    )
    want, _ = reference(q, k, v, scale, key_mask=mask, window=window)
    np.testing.assert_allclose(np.array(got), want, rtol=2e-4, atol=2e-5)
    if not masked and Dv == D:
        causal = create_causal_mask(N, S - N, window_size=window)
        theirs = mx.fast.scaled_dot_product_attention(*args[:3], scale=scale, mask=causal)
        np.testing.assert_allclose(np.array(got), np.array(theirs), rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("shape", SHAPES)
def test_reconstruction_scores_match_numpy(kernel, shape):
    """Each counted key's score: the max over the group's queries of its weight in the
    softmax over counted keys only; uncounted keys score 0; the output is the full one."""
    B, Hq, H, N, S, D, Dv = shape
    rng = np.random.default_rng(N * S)
    q, k, v = _inputs(rng, B, Hq, H, N, S, D, Dv)
    key_mask = rng.random((B, H, S)) > 0.2
    counted = rng.random((B, H, S)) > 0.4
    counted[..., S - N :] = True  # the block's own keys count (as the pass's do)
    out, scores = kernel.reconstruction_attention(
        mx.array(q), mx.array(k), mx.array(v), 0.25, mx.array(counted),
        key_mask=mx.array(key_mask),
    )  # fmt: skip
    want_out, want_scores = reference(q, k, v, 0.25, key_mask, counted)
    np.testing.assert_allclose(np.array(out), want_out, rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(np.array(scores), want_scores, rtol=1e-4, atol=1e-6)
    assert (np.array(scores)[~(counted & key_mask)] == 0).all()


def test_reconstruction_scores_only_the_asked_keys(kernel):
    """``score_from``/``score_to`` give the same scores on those keys and 0 elsewhere; the
    output is unchanged (the softmax still runs over every counted key)."""
    B, Hq, H, N, S, D, Dv = 1, 6, 2, 37, 300, 32, 32
    rng = np.random.default_rng(9)
    q, k, v = _inputs(rng, B, Hq, H, N, S, D, Dv)
    counted = rng.random((B, H, S)) > 0.3
    counted[..., S - N :] = True
    want_out, want_scores = reference(q, k, v, 0.25, None, counted)
    for lo, hi in ((70, 200), (0, 5), (130, 131), (250, 400), (64, 128)):
        out, scores = kernel.reconstruction_attention(
            mx.array(q), mx.array(k), mx.array(v), 0.25, mx.array(counted), score_from=lo,
            score_to=hi,
        )  # fmt: skip
        np.testing.assert_allclose(np.array(out), want_out, rtol=1e-4, atol=2e-5)
        inside = np.zeros(S, dtype=bool)
        inside[lo:hi] = True
        got = np.array(scores)
        np.testing.assert_allclose(got[..., inside], want_scores[..., inside], rtol=1e-4, atol=1e-6)
        assert (got[..., ~inside] == 0).all()


def test_prefill_attention_reads_any_strides(kernel):
    """Keys stored transposed, values and queries from wider buffers: read in place."""
    rng = np.random.default_rng(4)
    q_buf = rng.standard_normal((1, 6, 50, 40), dtype=np.float32)
    k_t = rng.standard_normal((1, 2, 32, 90), dtype=np.float32)  # (B, H, D, S)
    v_buf = rng.standard_normal((1, 2, 95, 32), dtype=np.float32)
    q, k, v = mx.array(q_buf)[..., :32], mx.array(k_t).swapaxes(2, 3), mx.array(v_buf)[:, :, :90]
    got = kernel.prefill_attention(q, k, v, 0.2)
    want, _ = reference(q_buf[..., :32], k_t.swapaxes(2, 3), v_buf[:, :, :90], 0.2)
    np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=2e-5)


def test_a_row_with_every_key_masked_gives_zeros(kernel):
    q, k, v = _inputs(np.random.default_rng(2), 1, 2, 1, 4, 10, 16)
    key_mask = np.zeros((1, 1, 10), dtype=bool)
    key_mask[..., 8:] = True  # the first two queries (positions 6 and 7) see nothing
    got = np.array(
        kernel.prefill_attention(mx.array(q), mx.array(k), mx.array(v), 1.0,
                                 key_mask=mx.array(key_mask))
    )  # fmt: skip
    assert (got[:, :, :2] == 0).all()
    want, _ = reference(q, k, v, 1.0, key_mask)
    np.testing.assert_allclose(got[:, :, 2:], want[:, :, 2:], rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        (((1, 9, 5, 64), (1, 3, 4, 64), (1, 3, 4, 64)), "do not match"),  # N > S
        (((1, 8, 2, 64), (1, 3, 5, 64), (1, 3, 5, 64)), "do not match"),  # 8 heads over 3
        (((1, 9, 2, 64), (1, 3, 5, 32), (1, 3, 5, 64)), "do not match"),
        (((9, 2, 64), (1, 3, 5, 64), (1, 3, 5, 64)), "4-D"),
    ],
)
def test_prefill_attention_refuses_bad_shapes(kernel, shapes, message):
    q, k, v = (mx.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        kernel.prefill_attention(q, k, v, 1.0)


def test_prefill_attention_refuses_bad_masks_and_dtypes(kernel):
    q, k, v = mx.zeros((1, 3, 2, 16)), mx.zeros((1, 3, 5, 16)), mx.zeros((1, 3, 5, 16))
    with pytest.raises(ValueError, match="key_mask must be bool"):
        kernel.prefill_attention(q, k, v, 1.0, key_mask=mx.ones((1, 3, 4), dtype=mx.bool_))
    with pytest.raises(ValueError, match="counted must be bool"):
        kernel.reconstruction_attention(q, k, v, 1.0, mx.ones((1, 3, 5)))
    with pytest.raises(ValueError, match="float32"):
        kernel.prefill_attention(q.astype(mx.float16), k, v, 1.0)
    with pytest.raises(ValueError, match="window must be >= 0"):
        kernel.prefill_attention(q, k, v, 1.0, window=-1)
