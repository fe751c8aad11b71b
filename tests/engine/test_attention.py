"""Per-head cache masks: attention equals an explicit numpy reference, and masked rows are
invisible to a real mlx-lm model (its logits do not change whatever the rows hold)."""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, create_attention_mask

from qfserve.engine.kv.attention import combine_masks, install_head_masks
from tests.tiny import make_tiny_model


def numpy_attention(q, k, v, scale, allowed):
    """``(B, Hq, N, D)`` attention with GQA, only over ``allowed`` ``(B, Hq, N, S)`` keys."""
    rep = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    logits = np.einsum("bhnd,bhsd->bhns", q.astype(np.float64), k) * scale
    logits = np.where(allowed, logits, -np.inf)
    w = np.exp(logits - logits.max(-1, keepdims=True))
    w /= w.sum(-1, keepdims=True)
    return np.einsum("bhns,bhsd->bhnd", w, v)


class Cache:
    def __init__(self, head_mask):
        self.head_mask = head_mask


def test_block_and_decode_masks_match_explicit_attention():
    from qfserve.engine.kv.attention import _masked

    rng = np.random.default_rng(0)
    B, Hq, Hkv, S, D = 2, 4, 2, 12, 8
    k = rng.standard_normal((B, Hkv, S, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, S, D)).astype(np.float32)
    head_mask = rng.random((B, Hkv, S)) > 0.3
    head_mask[..., -3:] = True  # the block's own rows are always valid
    sdpa = _masked(
        lambda q, k, v, cache, scale, mask: mx.fast.scaled_dot_product_attention(
            q, k, v, scale=scale, mask=mask
        )
    )
    for N, mask in ((3, "causal"), (1, None)):
        q = rng.standard_normal((B, Hq, N, D)).astype(np.float32)
        got = sdpa(mx.array(q), mx.array(k), mx.array(v), cache=Cache(mx.array(head_mask)),
                   scale=0.35, mask=mask)  # fmt: skip
        causal = np.arange(S - N, S)[:, None] >= np.arange(S)[None]
        allowed = np.repeat(head_mask, Hq // Hkv, axis=1)[:, :, None, :] & causal
        np.testing.assert_allclose(np.array(got), numpy_attention(q, k, v, 0.35, allowed),
                                   rtol=1e-4, atol=1e-5)  # fmt: skip


def test_an_additive_mask_keeps_its_values():
    q = mx.zeros((1, 2, 1, 4))
    additive = mx.array([[[[0.0, -1.0, -2.0]]]])
    out = combine_masks(additive, mx.array([[[True, False, True]]]), q)
    np.testing.assert_array_equal(np.array(out)[0, :, 0], [[0.0, -np.inf, -2.0]] * 2)


class PaddedCache:
    """Rows of ``base`` with ``pad`` rows of garbage stored after the first ``split``, masked
    out; ``offset`` stays the logical position (RoPE must not see the padding)."""

    def __init__(self, base: KVCache, split: int, pad: int, seed: int):
        rng = np.random.default_rng(seed)
        keys, values = base.keys[..., : base.offset, :], base.values[..., : base.offset, :]
        B, H, _, D = keys.shape
        junk = mx.array(rng.standard_normal((B, H, pad, D)).astype(np.float32) * 50)
        self.keys = mx.concatenate([keys[..., :split, :], junk, keys[..., split:, :]], axis=2)
        self.values = mx.concatenate(
            [values[..., :split, :], -junk, values[..., split:, :]], axis=2
        )
        self.offset = base.offset
        self.split, self.pad = split, pad

    def update_and_fetch(self, keys, values):
        self.keys = mx.concatenate([self.keys, keys], axis=2)
        self.values = mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2]
        rows = mx.arange(self.keys.shape[2])
        self.head_mask = mx.broadcast_to(
            (rows < self.split) | (rows >= self.split + self.pad), self.keys.shape[:3]
        )
        return self.keys, self.values

    def make_mask(self, N, return_array=False, window_size=None):
        return create_attention_mask(
            N, offset=self.keys.shape[2], return_array=return_array, window_size=window_size
        )

    @property
    def state(self):
        return self.keys, self.values


def test_masked_rows_are_invisible_to_the_model():
    model = make_tiny_model(seed=4)
    install_head_masks(model)
    module = sys.modules[type(model.layers[0].self_attn).__module__]
    wrapped = module.scaled_dot_product_attention
    install_head_masks(model)
    assert module.scaled_dot_product_attention is wrapped  # idempotent: wrapped once
    prompt = mx.array(np.random.default_rng(1).integers(0, 500, (1, 40)))
    plain = [KVCache() for _ in model.layers]
    model(prompt, cache=plain)
    for seed in (0, 1):
        padded = [PaddedCache(c, 17 + 10 * seed, 5, seed) for c in plain]
        reference = [PaddedCache(c, 40, 0, 0) for c in plain]  # the same rows, no padding
        for tokens in (prompt[:, :1], prompt[:, 5:12]):  # a decode step, then a block
            got = model(tokens, cache=padded)
            want = model(tokens, cache=reference)
            np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
