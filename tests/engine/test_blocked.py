"""Blocked CPU attention: equal to an explicit numpy softmax attention (grouped queries, keys
beyond the block, padding masks, unaligned offsets), the weights it shows an observer to
numpy's softmax, and a real model's logits to MLX's own attention."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from qfserve.engine.kv import attention, blocked
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.factory import make_caches
from tests.engine.test_attention import numpy_attention
from tests.tiny import make_tiny_model


def _inputs(rng, B, Hq, H, N, S, D=16):
    q = rng.standard_normal((B, Hq, N, D)).astype(np.float32)
    k = rng.standard_normal((B, H, S, D)).astype(np.float32)
    v = rng.standard_normal((B, H, S, D)).astype(np.float32)
    return q, k, v


@pytest.mark.parametrize(
    "N, S", [(32, 32), (33, 33), (70, 70), (40, 75), (100, 357), (1, 50), (64, 128)]
)
@pytest.mark.parametrize("masked", [False, True])
def test_block_attention_equals_numpy(N, S, masked):
    rng = np.random.default_rng(N * 1000 + S)
    B, Hq, H = 2, 6, 2
    q, k, v = _inputs(rng, B, Hq, H, N, S)
    key_mask = rng.random((B, H, S)) > 0.4 if masked else np.ones((B, H, S), dtype=bool)
    key_mask[..., S - N :] = True  # a block's own rows are real
    got = blocked.block_attention(
        mx.array(q), mx.array(k), mx.array(v), 0.3,
        key_mask=mx.array(key_mask) if masked else None,
    )  # fmt: skip
    causal = np.arange(S - N, S)[:, None] >= np.arange(S)[None]
    allowed = np.repeat(key_mask, Hq // H, axis=1)[:, :, None, :] & causal
    np.testing.assert_allclose(
        np.array(got), numpy_attention(q, k, v, 0.3, allowed), rtol=1e-4, atol=2e-5
    )


def test_the_observer_sees_the_softmax_weights():
    rng = np.random.default_rng(7)
    B, Hq, H, N, S = 2, 4, 2, 145, 210
    q, k, v = _inputs(rng, B, Hq, H, N, S)
    weights = np.zeros((B, H, Hq // H, N, S))
    first_query = S - N

    def observe(b, h, first, e, total):
        rows = e.shape[1]
        w = e / total
        weights[b, h, :, first - first_query : first - first_query + rows, : e.shape[-1]] = w

    blocked.block_attention(mx.array(q), mx.array(k), mx.array(v), 0.25, observe=observe)
    rep = Hq // H
    logits = np.einsum("bhnd,bhsd->bhns", q.astype(np.float64), np.repeat(k, rep, axis=1)) * 0.25
    causal = np.arange(S - N, S)[:, None] >= np.arange(S)[None]
    logits = np.where(causal, logits, -np.inf)
    ref = np.exp(logits - logits.max(-1, keepdims=True))
    ref /= ref.sum(-1, keepdims=True)
    np.testing.assert_allclose(weights.reshape(B, Hq, N, S), ref, atol=1e-6)


def test_a_model_reads_a_prompt_as_with_mlx_attention():
    """numpy's tiles and the native kernels (where they build) against MLX's attention."""
    from qfserve.engine.models.gguf.convert import cache_root
    from qfserve.kernels import native

    model = make_tiny_model()
    tokens = mx.array(np.random.default_rng(3).integers(0, 200, size=(1, 150)))
    kernel = native.load(cache_root() / "native")
    logits = {}
    try:
        for arm in ("mlx", "blocked", "native"):
            if arm == "native" and kernel is None:
                continue
            attention.set_blocked(arm != "mlx")
            attention.set_native(kernel if arm == "native" else None)
            caches = make_caches(model, CacheConfig(method="full"))
            out = model(tokens[:, :90], cache=caches)
            out = mx.concatenate([out, model(tokens[:, 90:], cache=caches)], axis=1)
            logits[arm] = np.array(out)
    finally:
        attention.set_blocked(True)
        attention.set_native(None)
    for arm in logits.keys() - {"mlx"}:
        np.testing.assert_allclose(logits[arm], logits["mlx"], rtol=1e-4, atol=1e-4)
        assert (logits[arm].argmax(-1) == logits["mlx"].argmax(-1)).all()
