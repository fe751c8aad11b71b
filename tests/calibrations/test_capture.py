"""Captured queries are the queries the model attends with: post-RoPE, at the right positions.

The reference is independent of the capture and of mlx-lm's rope module: the layer's input is
recomputed from the embedding and the earlier layers, projected with ``q_proj`` and rotated
with a numpy RoPE written here (mlx-lm's non-traditional layout: the two halves of each head
form the rotated pairs).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from qfserve.calibrations.capture import QueryCapture, capture_queries
from qfserve.calibrations.model_info import attention_shape, head_counts
from tests.tiny import TINY_CONFIG, make_tiny_model

L = 40


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=3)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, TINY_CONFIG["vocab_size"], L).astype(np.int32)


def _numpy_rope(x: np.ndarray, positions: np.ndarray, base: float) -> np.ndarray:
    """``x`` ``(H, L, D)`` rotated at ``positions`` ``(L,)``, rotate-half layout."""
    half = x.shape[-1] // 2
    inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2 / x.shape[-1])
    angle = positions[:, None].astype(np.float64) * inv_freq[None, :]  # (L, D/2)
    cos, sin = np.cos(angle), np.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def _reference_queries(model, tokens: np.ndarray, layer: int) -> np.ndarray:
    """``(H, L, D)`` post-RoPE queries of ``layer`` for one sequence starting at position 0."""
    h = model.model.embed_tokens(mx.array(tokens)[None])  # (1, L, dim)
    for block in model.layers[:layer]:
        h = block(h, mask="causal", cache=None)
    block = model.layers[layer]
    attn = block.self_attn
    x = block.input_layernorm(h)
    n_heads, _, head_dim = head_counts(attn, model)
    q = np.array(attn.q_proj(x)).reshape(len(tokens), n_heads, head_dim).transpose(1, 0, 2)
    return _numpy_rope(q, np.arange(len(tokens)), TINY_CONFIG["rope_theta"])


def _sorted(sample):
    order = np.argsort(sample.positions)
    return sample.queries[:, order], sample.positions[order]


@pytest.mark.parametrize("layer", [0, 1])
def test_one_block_matches_manual_projection_and_rope(model, tokens, layer):
    samples = capture_queries(model, [tokens], samples_per_head=1000)
    queries, positions = _sorted(samples[layer])
    np.testing.assert_array_equal(positions, np.arange(L))
    assert samples[layer].tokens_seen == L
    np.testing.assert_allclose(
        queries, _reference_queries(model, tokens, layer), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("layer", [0, 1])
def test_two_chunks_rotate_at_the_cache_offset(model, tokens, layer):
    """Fed as two chunks through a cache, the second chunk is rotated at offset 17, not 0."""
    with QueryCapture(model, samples_per_head=1000) as capture:
        cache = make_prompt_cache(model)
        model(mx.array(tokens[:17])[None], cache=cache)
        capture.flush()
        assert cache[0].offset == 17
        model(mx.array(tokens[17:])[None], cache=cache)
        capture.flush()
    queries, positions = _sorted(capture.samples()[layer])
    np.testing.assert_array_equal(positions, np.arange(L))
    np.testing.assert_allclose(
        queries, _reference_queries(model, tokens, layer), rtol=1e-4, atol=1e-4
    )


def test_chunked_capture_equals_one_block(model, tokens):
    one = capture_queries(model, [tokens], samples_per_head=1000)
    chunked = capture_queries(model, [tokens], samples_per_head=1000, chunk_size=7)
    for a, b in zip(one, chunked, strict=True):
        np.testing.assert_allclose(_sorted(a)[0], _sorted(b)[0], rtol=1e-4, atol=1e-4)


def test_sampling_is_bounded_uniform_and_seeded(model):
    rng = np.random.default_rng(1)
    seqs = [rng.integers(0, 500, 64).astype(np.int32) for _ in range(4)]  # 256 tokens
    samples = capture_queries(model, seqs, samples_per_head=50, chunk_size=32, seed=5)
    n_layers, _, head_dim = attention_shape(model)
    assert len(samples) == n_layers
    for s in samples:
        assert s.queries.shape == (4, 50, head_dim) and s.queries.dtype == np.float32
        assert s.tokens_seen == 256 and s.positions.min() >= 0 and s.positions.max() < 64
    again = capture_queries(model, seqs, samples_per_head=50, chunk_size=32, seed=5)
    np.testing.assert_array_equal(samples[0].queries, again[0].queries)
    # Priority sampling is uniform: over many seeds every position is kept equally often.
    counts = np.zeros(64)
    for seed in range(40):
        s = capture_queries(model, seqs[:1], samples_per_head=16, seed=seed)[0]
        counts += np.bincount(s.positions, minlength=64)
    assert counts.sum() == 40 * 16 and counts.max() < 3 * counts.mean()


def test_rope_is_restored_even_after_an_error(model, tokens):
    ropes = [layer.self_attn.rope for layer in model.layers]
    with pytest.raises(RuntimeError, match="boom"), QueryCapture(model):
        assert all(
            layer.self_attn.rope is not r for layer, r in zip(model.layers, ropes, strict=True)
        )
        raise RuntimeError("boom")
    assert all(layer.self_attn.rope is r for layer, r in zip(model.layers, ropes, strict=True))
    # The model computes exactly what it computed before.
    out = model(mx.array(tokens)[None])
    with QueryCapture(model):
        captured = model(mx.array(tokens)[None])
    np.testing.assert_array_equal(np.array(out), np.array(captured))


def test_mha_model_captures_queries_not_keys():
    """With as many KV heads as query heads the shape cannot tell queries from keys."""
    model = make_tiny_model(seed=4, num_key_value_heads=4)
    toks = np.arange(12, dtype=np.int32)
    sample = capture_queries(model, [toks], samples_per_head=100)[1]
    np.testing.assert_allclose(
        _sorted(sample)[0], _reference_queries(model, toks, 1), rtol=1e-4, atol=1e-4
    )


def test_bad_arguments(model):
    with pytest.raises(ValueError, match="samples_per_head must be >= 1, got 0"):
        QueryCapture(model, samples_per_head=0)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        capture_queries(model, [[1, 2]], chunk_size=0)
    with pytest.raises(ValueError, match=r"sequences\[1\] is empty"):
        capture_queries(model, [[1, 2], []])
