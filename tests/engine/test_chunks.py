"""Chunk-level selection against an independent numpy reference: block evictions keep whole
chunks ranked by their mean score, the decode step evicts the lowest-ranked row."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from qfserve.engine.kv.cache import EvictionCache
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.evict import chunk_scores
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.kv.scorers import ScorerBase
from tests.tiny import make_tiny_model

B, H, D = 2, 3, 8


class FirstComponent(ScorerBase):
    """Scores a key by its first component, so a test writes the scores into the keys."""

    source = "none"
    ready = True
    nbytes = 0

    def observe(self, keys: mx.array, tokens_seen: int) -> None:
        return None

    def score(self, keys: mx.array, start: int) -> mx.array:
        return keys[..., 0].astype(mx.float32)


def make_keys(L: int, seed: int) -> np.ndarray:
    """Keys whose component 0 is a distinct score and component 1 the position."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((B, H, L, D)).astype(np.float32)
    keys[..., 0] = rng.permutation(B * H * L).reshape(B, H, L) / 7.0
    keys[..., 1] = np.arange(L, dtype=np.float32)
    return keys


def ref_block(stored, token, budget, n_sink, recent, chunk):
    """Survivors of one block eviction of one (b, h) group.

    ``stored``: ascending positions held (survivors + the new block); ``token``: position ->
    its score. Ranks: the mean over the chunk's stored members; protected rows first, then
    rank descending, then position ascending.
    """
    stored = list(stored)
    if len(stored) <= budget:
        return stored
    members: dict[int, list[int]] = {}
    for p in stored:
        members.setdefault(p // chunk, []).append(p)
    rank = {p: np.mean([token[q] for q in members[p // chunk]], dtype=np.float64) for p in stored}
    L = len(stored)
    protected = {stored[i] for i in range(L) if i < n_sink or i >= L - recent}
    order = sorted(stored, key=lambda p: (p not in protected, -rank[p], p))
    return sorted(order[:budget])


def ref_cache(keys, blocks, budget, n_sink, recent, chunk):
    """Kept positions per (b, h) after feeding ``blocks`` (sizes) through a chunked cache;
    a block of one row into a full cache is a decode step (the lowest rank goes)."""
    out = {}
    for b, h in np.ndindex(B, H):
        token = {p: float(keys[b, h, p, 0]) for p in range(keys.shape[2])}
        stored: list[int] = []
        rank: dict[int, float] = {}
        start = 0
        for n in blocks:
            new = list(range(start, start + n))
            start += n
            if n == 1 and len(stored) >= budget:  # decode step at budget
                if not rank:  # the first eviction ranks the stored rows by chunk
                    rank = _chunk_means(stored, token, chunk)
                stored.append(new[0])
                rank[new[0]] = token[new[0]]  # a decoded row carries its own score
                recent_rows = set(stored[-recent:]) if recent else set()
                candidates = [p for p in stored[n_sink:] if p not in recent_rows]
                victim = min(candidates, key=lambda p: (rank[p], -p))
                stored.remove(victim)
                continue
            stored = ref_block(stored + new, token, budget, n_sink, recent, chunk)
            rank = _chunk_means(stored, token, chunk) if len(stored) == budget else {}
        out[(b, h)] = stored
    return out


def _chunk_means(stored, token, chunk):
    members: dict[int, list[float]] = {}
    for p in stored:
        members.setdefault(p // chunk, []).append(token[p])
    return {p: float(np.mean(members[p // chunk], dtype=np.float64)) for p in stored}


def kept_positions(cache: EvictionCache) -> dict[tuple[int, int], list[int]]:
    keys, _, _ = cache.kept()
    pos = np.array(keys)[..., 1].astype(int)
    return {(b, h): sorted(pos[b, h].tolist()) for b, h in np.ndindex(B, H)}


def test_chunk_scores_are_chunk_means_over_stored_members() -> None:
    rng = np.random.default_rng(0)
    positions = np.sort(rng.choice(200, size=(B, H, 60), replace=True), axis=-1).astype(np.int32)
    scores = rng.standard_normal((B, H, 60)).astype(np.float32)
    got = np.array(chunk_scores(mx.array(scores), mx.array(positions), 8))
    for b, h in np.ndindex(B, H):
        ids = positions[b, h] // 8
        want = np.array([scores[b, h][ids == i].mean() for i in ids])
        np.testing.assert_allclose(got[b, h], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(
        np.array(chunk_scores(mx.array(scores), mx.array(positions), 1)), scores
    )


@pytest.mark.parametrize(
    ("budget", "n_sink", "recent", "chunk"),
    [(48, 4, 0, 4), (48, 4, 12, 8), (50, 2, 5, 16), (33, 0, 0, 8), (40, 4, 10, 3)],
)
def test_block_eviction_keeps_whole_chunks_like_the_reference(budget, n_sink, recent, chunk):
    keys = make_keys(200, seed=budget + chunk)
    cache = EvictionCache(
        FirstComponent(), budget=budget, n_sink=n_sink, recent=recent, chunk=chunk
    )
    cache.update_and_fetch(mx.array(keys), mx.array(keys))
    got = kept_positions(cache)
    assert got == ref_cache(keys, [200], budget, n_sink, recent, chunk)
    for kept in got.values():
        assert len(kept) == budget
        # Outside the protected rows every chunk is kept whole or dropped, but at most one.
        free = [p for p in kept if p >= n_sink and p < 200 - recent]
        partial = [
            c
            for c in {p // chunk for p in free}
            if sum(1 for p in free if p // chunk == c)
            != sum(1 for p in range(n_sink, 200 - recent) if p // chunk == c)
        ]
        assert len(partial) <= 1 + 2  # the boundary chunk, and the two cut by protection
        assert all(p in kept for p in range(n_sink))
        assert all(p in kept for p in range(200 - recent, 200))


@pytest.mark.parametrize("chunk", [4, 8])
@pytest.mark.parametrize("recent", [0, 6])
def test_prefill_blocks_then_decode_follow_the_reference(chunk, recent):
    """Chunked prefill (block evictions over survivors + block), then decode steps that
    evict the lowest-ranked row, then a new block (a new turn) compacting the slots."""
    keys = make_keys(260, seed=chunk * 10 + recent)
    blocks = [64, 64, 64] + [1] * 30 + [38]
    cache = EvictionCache(FirstComponent(), budget=40, n_sink=4, recent=recent, chunk=chunk)
    start = 0
    want_steps = []
    for i, n in enumerate(blocks):
        k = mx.array(keys[:, :, start : start + n])
        cache.update_and_fetch(k, k)
        start += n
        if i in (2, 10, 32, 33):  # after prefill, mid-decode, end of decode, after the turn
            want_steps.append((i, kept_positions(cache)))
            assert cache.size() == 40
    for i, got in want_steps:
        assert got == ref_cache(keys[:, :, : sum(blocks[: i + 1])], blocks[: i + 1], 40, 4,
                                recent, chunk), f"after block {i}"  # fmt: skip


def test_chunked_slot_layout_round_trips_through_state() -> None:
    keys = mx.array(make_keys(120, seed=3))
    cache = EvictionCache(FirstComponent(), budget=32, n_sink=4, recent=4, chunk=8)
    cache.update_and_fetch(keys[:, :, :100], keys[:, :, :100])
    for i in range(100, 110):
        cache.update_and_fetch(keys[:, :, i : i + 1], keys[:, :, i : i + 1])
    assert cache.free is not None and len(cache.state) == 7
    restored = EvictionCache.__new__(EvictionCache)
    restored.state, restored.meta_state = cache.state, cache.meta_state
    assert restored.chunk == 8 and restored.positions is not None
    restored.scorer = cache.scorer
    for a, b in zip(restored.kept(), cache.kept(), strict=True):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    tail = keys[:, :, 110:]
    cache.update_and_fetch(tail, tail)
    restored.update_and_fetch(tail, tail)
    assert kept_positions(restored) == kept_positions(cache)
    assert cache.nbytes == sum(x.nbytes for x in cache.state)


def test_under_budget_generation_is_unchanged_by_chunking() -> None:
    model = make_tiny_model(seed=1)
    prompt = mx.array(np.random.default_rng(2).integers(0, 500, (1, 150)))
    full = make_prompt_cache(model)
    chunked = make_caches(model, CacheConfig(method="knorm", budget=512, chunk=16))
    for s in range(0, 150, 50):
        want = model(prompt[:, s : s + 50], cache=full)
        got = model(prompt[:, s : s + 50], cache=chunked)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"chunk": 0}, "chunk must be >= 1"),
    ({"chunk": 64, "budget": 64}, "chunk must be < budget"),
    ({"chunk": 2.0}, "chunk must be an integer"),
])  # fmt: skip
def test_invalid_chunk_is_refused_naming_it(kwargs, message) -> None:
    with pytest.raises(ValueError, match=message) as err:
        CacheConfig(**kwargs)
    assert err.value.param == "chunk"


def test_a_state_saved_before_the_scorer_is_ready_restores_its_positions():
    from qfserve.engine.kv.scorers import KeySVDScorer

    keys = mx.array(make_keys(80, seed=9))
    cache = EvictionCache(KeySVDScorer(64), budget=32, n_sink=4, recent=4, chunk=4)
    cache.update_and_fetch(keys[:, :, :10], keys[:, :, :10])
    restored = EvictionCache(KeySVDScorer(64), budget=32, n_sink=4, recent=4, chunk=4)
    restored.state, restored.meta_state = cache.state, cache.meta_state
    for c in (cache, restored):
        c.update_and_fetch(keys[:, :, 10:20], keys[:, :, 10:20])
        c.update_and_fetch(keys[:, :, 20:], keys[:, :, 20:])
    assert kept_positions(restored) == kept_positions(cache)
    assert restored.size() == 32 and restored.offset == 80
