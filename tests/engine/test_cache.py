"""EvictionCache on real mlx-lm models: protocol, RoPE contract, path (in)dependence."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import KVCache, create_attention_mask, make_prompt_cache

from qfserve.engine.kv.cache import EvictionCache, FullKVCache
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.kv.scorers import KeySVDScorer, QFilterScorer
from qfserve.engine.kv.stats import summarize
from tests.tiny import TINY_CONFIG, make_tiny_model

METHODS = ["qfilters", "knorm", "streaming", "full"]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=1)


@pytest.fixture(scope="module")
def filters():
    rng = np.random.default_rng(0)
    f = rng.standard_normal(
        (
            TINY_CONFIG["num_hidden_layers"],
            TINY_CONFIG["num_key_value_heads"],
            TINY_CONFIG["head_dim"],
        )
    ).astype(np.float32)
    return f / np.linalg.norm(f, axis=-1, keepdims=True)


def greedy(model, prompt, caches, n):
    steps = generate_step(mx.array(prompt), model, prompt_cache=caches, max_tokens=n)
    return [tok for tok, _ in steps]


@pytest.mark.parametrize("method", METHODS)
def test_under_budget_generation_equals_mlx_lm(model, filters, method):
    prompt = np.random.default_rng(2).integers(0, 500, 150).tolist()
    reference = greedy(model, prompt, make_prompt_cache(model), 80)
    caches = make_caches(
        model,
        CacheConfig(method=method, budget=512),
        filters=filters if method == "qfilters" else None,
    )
    assert greedy(model, prompt, caches, 80) == reference
    assert len(set(reference)) > 3  # the comparison is not between two constant streams
    stats = summarize(caches)
    # generate_step computes one token ahead of what it yields.
    assert stats.tokens_seen == 150 + 80 and stats.tokens_kept == stats.tokens_seen
    assert stats.compression_ratio == 1.0 and stats.evictions == 0


def test_factory_replaces_only_plain_kv_caches(model, filters):
    caches = make_caches(model, CacheConfig(budget=64), filters=filters)
    assert all(isinstance(c, EvictionCache) for c in caches)
    assert all(isinstance(c.scorer, QFilterScorer) for c in caches)
    assert all(isinstance(c.scorer, KeySVDScorer) for c in make_caches(model, CacheConfig()))
    assert all(type(c) is FullKVCache for c in make_caches(model, CacheConfig(method="full")))
    assert not any(hasattr(c, "bits") for c in caches)

    # A model with sliding-window layers keeps its RotatingKVCache layers as they are.
    mixed = make_tiny_model(layer_types=["sliding_attention", "full_attention"], sliding_window=16)
    built = make_caches(mixed, CacheConfig(budget=64))
    assert type(built[0]).__name__ == "RotatingKVCache" and isinstance(built[1], EvictionCache)


def test_filters_with_the_wrong_layout_are_refused(model, filters):
    with pytest.raises(ValueError, match="n_kv_heads"):
        make_caches(model, CacheConfig(), filters=filters[:, :1])
    with pytest.raises(ValueError, match="n_layers"):
        make_caches(model, CacheConfig(), filters=filters[:1])
    with pytest.raises(ValueError, match="only used by methods 'qfilters' and 'kvzip'"):
        make_caches(model, CacheConfig(method="knorm"), filters=filters)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"budget": 0}, "budget"),
        ({"budget": -3}, "budget"),
        ({"n_sink": -1}, "n_sink"),
        ({"recent": -1}, "recent"),
        ({"sign": 0}, "sign"),
        ({"sign": 2}, "sign"),
        ({"calib_tokens": 0}, "calib_tokens"),
        ({"budget": 8, "n_sink": 4, "recent": 4}, "n_sink"),
        ({"method": "h2o"}, "method"),
        ({"kernel": "maybe"}, "kernel"),
        ({"budget": 1.5}, "budget"),
    ],
)
def test_invalid_config_names_the_parameter(kwargs, param):
    with pytest.raises(ValueError, match=param):
        CacheConfig(**kwargs)


def _feed(cache, keys, values, chunk):
    for s in range(0, keys.shape[2], chunk):
        cache.update_and_fetch(keys[:, :, s : s + chunk], values[:, :, s : s + chunk])
    mx.eval(cache.state)


@pytest.mark.parametrize("recent", [0, 16])
def test_calibrated_kept_set_is_invariant_to_chunking(filters, recent):
    rng = np.random.default_rng(5)
    keys = mx.array(rng.standard_normal((2, 2, 700, 32)).astype(np.float32))
    values = mx.array(rng.standard_normal((2, 2, 700, 32)).astype(np.float32))
    results = []
    for chunk in (700, 7, 64, 256, 1):
        cache = EvictionCache(QFilterScorer(mx.array(filters[0])), budget=96, recent=recent)
        _feed(cache, keys, values, chunk)
        kept_keys, kept_values, _ = cache.kept()
        results.append((np.array(kept_keys), np.array(kept_values), cache.offset))
    for k, v, offset in results[1:]:
        np.testing.assert_array_equal(k, results[0][0])
        np.testing.assert_array_equal(v, results[0][1])
        assert offset == results[0][2] == 700


def planted_keys(n, axis, seed=0):
    """Keys whose dominant (uncentred) axis is ``axis``: a large drift plus small noise."""
    rng = np.random.default_rng(seed)
    noise = rng.standard_normal((1, 2, n, axis.size)).astype(np.float32)
    coef = 6.0 + rng.standard_normal((1, 2, n, 1)).astype(np.float32)
    return mx.array(noise + coef * axis[None, None, None, :])


@pytest.mark.parametrize("chunk", [1, 7, 64, 256])
def test_fallback_warms_up_then_respects_budget(chunk):
    D = 32
    axis = np.random.default_rng(9).standard_normal(D).astype(np.float32)
    axis /= np.linalg.norm(axis)
    keys = planted_keys(600, axis)
    cache = EvictionCache(KeySVDScorer(calib_tokens=128), budget=48, n_sink=4, recent=8)
    for s in range(0, 600, chunk):
        cache.update_and_fetch(keys[:, :, s : s + chunk], keys[:, :, s : s + chunk])
        if cache.offset < 128:
            assert cache.size() == cache.offset and cache.evictions == 0
            assert cache.stats().filter_source == "fallback"
        else:
            assert cache.size() <= 48
    direction = np.array(cache.scorer.direction)  # (B, H, D)
    np.testing.assert_allclose(np.linalg.norm(direction, axis=-1), 1.0, atol=1e-5)
    assert np.all(np.abs(direction @ axis) > 0.99)
    assert cache.offset == 600 and cache.stats().filter_bytes == direction.nbytes


def test_fallback_sign_is_a_convention_and_direction_is_path_dependent():
    # Sign: flipping every key flips the estimate, so which end of the axis is "important"
    # comes from the data's orientation, not from any query: the direction points against
    # the keys' mean (keys low on their shared axis are kept).
    D = 32
    rng = np.random.default_rng(4)
    axis = rng.standard_normal(D).astype(np.float32)
    axis /= np.linalg.norm(axis)
    keys = planted_keys(256, axis, seed=2)
    up, down = KeySVDScorer(128), KeySVDScorer(128)
    up.observe(keys, 256)
    down.observe(-keys, 256)
    cos_up = np.array(up.direction) @ axis
    cos_down = np.array(down.direction) @ axis
    assert np.all(cos_up < -0.99) and np.all(cos_down > 0.99)
    mean_projection = np.einsum("bhtd,bhd->bh", np.array(keys), np.array(up.direction))
    assert np.all(mean_projection < 0)

    # Path: the first 128 keys point one way, the rest another. Freezing after 128 keys
    # (token by token) and after all 512 (one block) gives different directions.
    other = rng.standard_normal(D).astype(np.float32)
    other -= (other @ axis) * axis
    other /= np.linalg.norm(other)
    keys = mx.concatenate([planted_keys(128, axis, 3), planted_keys(384, other, 4)], axis=2)
    directions = []
    for chunk in (1, 512):
        cache = EvictionCache(KeySVDScorer(128), budget=64)
        _feed(cache, keys, keys, chunk)
        directions.append(np.array(cache.scorer.direction))
        assert cache.size() == 64
    assert np.all(np.abs(directions[0] @ axis) > 0.95)
    assert np.all(np.abs(directions[1] @ other) > 0.9)


class FixedCache:
    """Test-only cache: given rows, placed at a known absolute position (the reference)."""

    def __init__(self, keys, values, position):
        self.keys, self.values, self.offset = keys, values, position

    def update_and_fetch(self, keys, values):
        self.keys = mx.concatenate([self.keys, keys], axis=2)
        self.values = mx.concatenate([self.values, values], axis=2)
        self.offset += keys.shape[2]
        return self.keys, self.values

    def make_mask(self, N, return_array=False, window_size=None):
        return create_attention_mask(N, self.keys.shape[2], return_array, window_size)


class Recorder:
    """Wraps a cache, recording every inserted row at the position the test counts itself."""

    def __init__(self, cache):
        self.cache = cache
        self.rows = {}  # position -> (key, value) as inserted

    def __getattr__(self, name):
        return getattr(self.cache, name)

    def record(self, keys, values, first_position):
        for i in range(keys.shape[2]):
            self.rows[first_position + i] = (keys[:, :, i], values[:, :, i])


def kept_positions(cache, rows):
    """Match each stored row to the position it was inserted at, per head."""
    stored = np.array(cache.kept()[0])  # (1, H, S, D), temporal order
    positions = sorted(rows)
    table = np.stack([np.array(rows[p][0]) for p in positions], axis=2)  # (1, H, T, D)
    out = []
    for h in range(stored.shape[1]):
        match = (stored[0, h][:, None, :] == table[0, h][None, :, :]).all(-1)  # (S, T)
        assert (match.sum(-1) == 1).all()
        out.append([positions[j] for j in match.argmax(-1)])
    return out


def reference_caches(caches, recorders, position):
    """Per layer, the recorded rows at the kept positions, placed at the true position."""
    out = []
    for cache, rec in zip(caches, recorders, strict=True):
        per_head = kept_positions(cache, rec.rows)
        k = mx.stack(
            [mx.stack([rec.rows[p][0][0, h] for p in ps]) for h, ps in enumerate(per_head)]
        )
        v = mx.stack(
            [mx.stack([rec.rows[p][1][0, h] for p in ps]) for h, ps in enumerate(per_head)]
        )
        out.append(FixedCache(k[None], v[None], position))
    return out


@pytest.mark.parametrize("method", ["qfilters", "knorm", "streaming"])
def test_rope_contract_offset_and_logits_after_eviction(model, filters, method):
    budget = 64
    caches = make_caches(
        model,
        CacheConfig(method=method, budget=budget, recent=8),
        filters=filters if method == "qfilters" else None,
    )
    recorders = [Recorder(c) for c in caches]
    for c, rec in zip(caches, recorders, strict=True):
        original = c.update_and_fetch

        def wrapped(keys, values, c=c, rec=rec, original=original):
            rec.record(keys, values, c.offset)
            return original(keys, values)

        c.update_and_fetch = wrapped

    rng = np.random.default_rng(11)
    seen = 0

    def step(tokens):
        nonlocal seen
        refs = reference_caches(caches, recorders, seen) if seen else None
        logits = model(mx.array(tokens)[None], cache=caches)
        seen += len(tokens)
        assert all(c.offset == seen for c in caches)
        assert all(c.size() <= budget for c in caches)
        if refs is not None:
            expected = model(mx.array(tokens)[None], cache=refs)
            np.testing.assert_allclose(np.array(logits), np.array(expected), rtol=1e-4, atol=1e-4)
        return logits

    step(rng.integers(0, 500, 200).tolist())
    assert all(c.evictions == 1 for c in caches)
    for _ in range(120):
        step([int(rng.integers(0, 500))])
    step(rng.integers(0, 500, 17).tolist())  # a second multi-token block after eviction

    # The check can fail: the same rows placed at the stored-row count instead of the true
    # position (the classic offset bug) give different logits.
    token = mx.array([[7]])
    good = model(token, cache=reference_caches(caches, recorders, seen))
    drifted = model(token, cache=reference_caches(caches, recorders, budget))
    assert not np.allclose(np.array(good), np.array(drifted), atol=1e-3)


def test_protocol_state_trim_and_bytes(model):
    cache = EvictionCache(KeySVDScorer(128), budget=16, n_sink=2)
    keys = mx.array(np.random.default_rng(0).standard_normal((1, 2, 10, 8)).astype(np.float32))
    assert cache.empty() and cache.size() == 0 and cache.nbytes == 0
    cache.update_and_fetch(keys, keys)
    assert cache.is_trimmable() and cache.trim(3) == 3 and cache.offset == 7 and cache.size() == 7
    assert cache.make_mask(1) is None
    mask = cache.make_mask(4, return_array=True)
    assert mask.shape == (4, 11) and bool(mask[:, :7].all())
    restored = EvictionCache(KeySVDScorer(128), budget=16)
    restored.state, restored.meta_state = cache.state, cache.meta_state
    assert restored.offset == 7 and restored.size() == 7

    big = EvictionCache(KeySVDScorer(4), budget=16, n_sink=2)
    big.update_and_fetch(mx.concatenate([keys] * 4, axis=2), mx.concatenate([keys] * 4, axis=2))
    assert big.size() == 16 and not big.is_trimmable() and big.trim(2) == 0
    s = big.stats()
    row = 2 * 8 * 4 * 2
    assert (s.tokens_seen, s.tokens_kept, s.kept_bytes, s.full_seq_bytes) == (
        40,
        16,
        16 * row,
        40 * row,
    )
    assert s.compression_ratio == pytest.approx(2.5)
    assert big.nbytes == 16 * row + 16 * 2 * 4
    assert isinstance(KVCache(), KVCache)


def test_decode_step_is_lazy_and_skips_the_full_sort(model, filters, monkeypatch):
    from qfserve import kernels

    caches = make_caches(model, CacheConfig(budget=32, recent=4), filters=filters)
    model(mx.arange(100)[None], cache=caches)  # prefill: the general path evicts 68 rows
    mx.eval([c.state for c in caches])

    def forbidden(*args, **kwargs):
        raise AssertionError("called during a single-token decode step")

    monkeypatch.setattr(kernels, "fused_evict", forbidden)  # no block eviction (sort) per token
    monkeypatch.setattr(mx, "eval", forbidden)  # no synchronisation inside update_and_fetch
    monkeypatch.setattr(mx, "async_eval", forbidden)
    for t in range(5):
        model(mx.array([[t]]), cache=caches)
    monkeypatch.undo()
    mx.eval([c.state for c in caches])
    assert all(c.size() == 32 and c.offset == 105 for c in caches)


def test_kernel_setting_is_resolved_once_at_construction(model):
    from qfserve import kernels

    with pytest.raises(RuntimeError, match="neither a Metal nor a CUDA"):
        make_caches(model, CacheConfig(budget=64, kernel="on"))
    with pytest.raises(ValueError, match="budget"):
        make_caches(model, CacheConfig(budget=kernels.MAX_BUDGET + 1, kernel="on"))
    assert not any(c.use_kernel for c in make_caches(model, CacheConfig(budget=64)))
    with kernels.use_backend("metal"):  # pretend a backend exists: construction only
        assert all(c.use_kernel for c in make_caches(model, CacheConfig(budget=64)))
        assert all(c.use_kernel for c in make_caches(model, CacheConfig(budget=64, kernel="on")))
        auto_big = make_caches(model, CacheConfig(budget=kernels.MAX_BUDGET + 1))
        assert not any(c.use_kernel for c in auto_big)  # auto falls back above the bound
        assert not any(c.use_kernel for c in make_caches(model, CacheConfig(kernel="off")))
    # The full arm never evicts, so it never needs the kernel, even when forced on.
    assert make_caches(model, CacheConfig(method="full", kernel="on"))


def test_slot_layout_round_trips_through_state_and_compacts_for_a_block(filters):
    rng = np.random.default_rng(8)
    keys = mx.array(rng.standard_normal((2, 2, 90, 32)).astype(np.float32))
    cache = EvictionCache(QFilterScorer(mx.array(filters[0])), budget=24, n_sink=2, recent=5)
    _feed(cache, keys[:, :, :40], keys[:, :, :40], 40)  # a block: temporal order
    _feed(cache, keys[:, :, 40:70], keys[:, :, 40:70], 1)  # decode: slot layout
    assert cache.free is not None and cache.size() == 24 and len(cache.state) == 5
    assert cache.stats().kept_bytes == 24 * 2 * 2 * 32 * 4 * 2
    restored = EvictionCache(QFilterScorer(mx.array(filters[0])), budget=24, n_sink=2, recent=5)
    restored.state, restored.meta_state = cache.state, cache.meta_state
    for a, b in zip(restored.kept(), cache.kept(), strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))

    # A block after decode steps sees the kept rows compacted back into temporal order.
    reference = EvictionCache(QFilterScorer(mx.array(filters[0])), budget=24, n_sink=2, recent=5)
    _feed(reference, keys[:, :, :70], keys[:, :, :70], 70)
    _feed(cache, keys[:, :, 70:], keys[:, :, 70:], 20)
    _feed(reference, keys[:, :, 70:], keys[:, :, 70:], 20)
    assert cache.free is None
    np.testing.assert_array_equal(np.array(cache.keys), np.array(reference.keys))
