"""EvictionCache with head-adaptive budgets against a numpy simulation: block evictions share
the layer's budget (floors first), decode steps evict one row per head, padding stays masked."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from qfserve.engine.kv.cache import EvictionCache
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.factory import make_caches
from tests.engine.test_adaptive import ref_adaptive
from tests.engine.test_chunks import FirstComponent
from tests.tiny import TINY_CONFIG, make_tiny_model

B, H, D = 1, 3, 8
BUDGET, N_SINK, RECENT, FLOOR = 16, 2, 3, 6


def make_keys(L: int, seed: int, *, fading: bool = False) -> np.ndarray:
    """Component 0 is the score (heads on scales 0.1, 1 and 5), component 1 the position;
    ``fading``: later rows score lower, so only the recent window keeps the latest ones."""
    rng = np.random.default_rng(seed)
    keys = rng.standard_normal((B, H, L, D)).astype(np.float32)
    keys[..., 0] = rng.permutation(B * H * L).reshape(B, H, L) / (B * H * L)
    if fading:
        keys[..., 0] = np.sort(keys[..., 0], axis=-1)[..., ::-1]
    keys[..., 0] *= np.array([0.1, 1.0, 5.0])[:, None]
    keys[..., 1] = np.arange(L, dtype=np.float32)
    return keys


def chunk_means(score: np.ndarray, rows: list[int], chunk: int) -> dict[int, float]:
    """Each row's rank: the mean score of the given rows in its chunk (``p // chunk``)."""
    groups: dict[int, list[float]] = {}
    for p in rows:
        groups.setdefault(p // chunk, []).append(float(score[p]))
    return {p: float(np.mean(groups[p // chunk])) for p in rows}


def simulate(keys: np.ndarray, blocks: list[int], chunk: int = 1) -> list[list[int]]:
    """Kept positions per head after each block (decode steps are blocks of one).

    A block shares the layer's rows by expected log attention weight (each head's scores
    less their log-sum-exp). With chunks, a block ranks rows by their chunk's mean over the head's rows; the first
    decode eviction after a block ranks the stored rows the same way once, and every decoded
    row by its own score."""
    score = keys[0, :, :, 0]
    stored: list[list[int]] = [[] for _ in range(H)]
    rank: list[dict[int, float]] | None = None  # the decode step's ranks, since the last block
    start = 0
    for n in blocks:
        new = list(range(start, start + n))
        start += n
        total = sum(len(s) for s in stored) + n * H
        if n == 1 and total > BUDGET * H:  # decode: each head drops one row
            if rank is None:
                rank = [chunk_means(score[h], stored[h], chunk) for h in range(H)]
            for h in range(H):
                rank[h][new[0]] = float(score[h, new[0]])
                rows = stored[h] + new
                free = rows[N_SINK : len(rows) - RECENT]
                stored[h] = sorted(set(rows) - {min(free, key=lambda p: (rank[h][p], -p))})
            continue
        rank = None
        if total > BUDGET * H:  # a block: the heads share budget x H rows
            S = max(len(s) for s in stored) + n
            # As stored: each head's rows, its padding, then the block (the recent rows last).
            pad = [s + [-1] * (S - n - len(s)) + new for s in stored]
            means = [chunk_means(score[h], [p for p in r if p >= 0], chunk)
                     for h, r in enumerate(pad)]  # fmt: skip
            table = np.array([[means[h][p] if p >= 0 else 0.0 for p in r]
                              for h, r in enumerate(pad)])  # fmt: skip
            eligible = np.array([[p >= 0 for p in r] for r in pad])
            # Compared across heads: expected log attention weights, each head's ranks less
            # their log-sum-exp over its real rows.
            for h in range(H):
                real_ranks = table[h][eligible[h]].astype(np.float64)
                top = real_ranks.max()
                table[h] -= top + np.log(np.exp(real_ranks - top).sum())
            # Protected rows are the first of each head's real rows and the block's last.
            keep = np.zeros_like(eligible)
            for h in range(H):
                real = [i for i, p in enumerate(pad[h]) if p >= 0]
                prot = set(real[:N_SINK]) | set(real[len(real) - RECENT :])  # first/last real
                order = sorted(real, key=lambda i: (i not in prot, -table[h, i], i))
                keep[h, order[:FLOOR]] = True
            rest = [(h, i) for h in range(H) for i in range(S) if eligible[h, i] and not keep[h, i]]
            rest.sort(key=lambda hi: (-table[hi], hi[0], hi[1]))
            for h, i in rest[: (BUDGET - FLOOR) * H]:
                keep[h, i] = True
            stored = [[p for i, p in enumerate(pad[h]) if keep[h, i]] for h in range(H)]
        else:
            stored = [s + new for s in stored]
    return stored


def kept_positions(cache: EvictionCache) -> list[list[int]]:
    keys, _, _ = cache.kept()
    pos = np.array(keys)[0, :, :, 1].astype(int)
    if cache.free is None and cache.valid is not None:
        valid = np.array(cache.valid)[0]
    elif cache.free is not None and cache.valid is not None:
        counts = np.array(cache.valid).sum(-1)[0] - 1
        valid = np.arange(pos.shape[-1])[None] < counts[:, None]
    else:
        valid = np.ones(pos.shape, bool)
    return [sorted(pos[h][valid[h]].tolist()) for h in range(H)]


def feed(cache: EvictionCache, keys: np.ndarray, blocks: list[int]) -> None:
    start = 0
    for n in blocks:
        k = mx.array(keys[:, :, start : start + n])
        out_keys, _ = cache.update_and_fetch(k, k)
        if cache.head_mask is not None:
            assert cache.head_mask.shape == out_keys.shape[:3]
        start += n


def test_one_block_matches_the_selection_reference():
    keys = make_keys(60, seed=0)
    cache = EvictionCache(
        FirstComponent(), budget=BUDGET, n_sink=N_SINK, recent=RECENT, floor=FLOOR
    )
    cache.update_and_fetch(mx.array(keys), mx.array(keys))
    keep = ref_adaptive(keys[..., 0], BUDGET, N_SINK, RECENT, FLOOR)
    want = [np.flatnonzero(keep[0, h]).tolist() for h in range(H)]
    got = kept_positions(cache)
    assert got == want
    counts = [len(g) for g in got]
    assert sum(counts) == BUDGET * H and min(counts) >= FLOOR and max(counts) > BUDGET
    assert cache.stats().tokens_kept == BUDGET


@pytest.mark.parametrize(
    "blocks",
    [
        [40, 40, 40],  # chunked prefill: padding enters the next selection
        [50] + [1] * 12,  # prefill, then decode steps per head
        [50] + [1] * 12 + [30] + [1] * 5,  # a new turn after decode, then decode again
        [10] + [1] * 20,  # a prompt under budget, then decode past it (per head, as always)
        [60, 2, 1, 1],  # a block shorter than the recent window after ragged heads
    ],
)
@pytest.mark.parametrize("fading", [False, True])
@pytest.mark.parametrize("chunk", [1, 4])
def test_blocks_and_decode_follow_the_simulation(blocks, fading, chunk):
    keys = make_keys(sum(blocks), seed=len(blocks), fading=fading)
    cache = EvictionCache(
        FirstComponent(), budget=BUDGET, n_sink=N_SINK, recent=RECENT, floor=FLOOR, chunk=chunk
    )
    start = 0
    for i, n in enumerate(blocks):  # after every block and every decode step
        feed(cache, keys[:, :, start : start + n], [n])
        start += n
        want = simulate(keys, blocks[: i + 1], chunk)
        assert kept_positions(cache) == want, f"after block {i}"


def test_the_head_mask_marks_padding_and_the_slot_layout_round_trips():
    keys = make_keys(80, seed=7)
    cache = EvictionCache(
        FirstComponent(), budget=BUDGET, n_sink=N_SINK, recent=RECENT, floor=FLOOR
    )
    feed(cache, keys, [60, 1, 1])
    assert cache.free is not None and cache.valid is not None
    mask = np.array(cache.head_mask)[0]
    counts = [len(p) for p in simulate(keys, [60, 1, 1])]
    assert (mask.sum(-1) == np.array(counts) + 1).all()  # kept rows + the free slot
    restored = EvictionCache.__new__(EvictionCache)
    restored.state, restored.meta_state = cache.state, cache.meta_state
    restored.scorer = cache.scorer
    assert restored.floor == FLOOR and restored.valid is not None
    assert kept_positions(restored) == kept_positions(cache)
    assert cache.nbytes == sum(x.nbytes for x in cache.state[:3]) + cache.valid.nbytes


def test_ragged_heads_under_their_budget_grow_then_evict_one_row_per_head():
    """A budget raised after a block eviction (KVzip's layer share, a question appended
    uncompressed): decoded rows join every head, dropping none, until the layer holds
    ``budget * H`` rows; from then each step drops one row per head."""
    keys = make_keys(60, seed=11)
    cache = EvictionCache(
        FirstComponent(), budget=BUDGET, n_sink=N_SINK, recent=RECENT, floor=FLOOR
    )
    feed(cache, keys, [50])
    before = kept_positions(cache)
    assert sum(map(len, before)) == BUDGET * H and len({len(p) for p in before}) > 1
    cache.budget = BUDGET + 2
    feed(cache, keys[:, :, 50:], [1, 1])  # under the raised budget: nothing is dropped
    assert cache.free is None and cache.evictions == 1
    assert kept_positions(cache) == [p + [50, 51] for p in before]
    feed(cache, keys[:, :, 52:], [1])  # full again: one row per head goes
    after = kept_positions(cache)
    assert cache.evictions == 2 and sum(map(len, after)) == (BUDGET + 2) * H
    assert all(52 in p and len(p) == len(q) + 2 for p, q in zip(after, before, strict=True))


def test_factory_refuses_adaptive_budgets_it_cannot_honour():
    model = make_tiny_model(seed=1)
    shape = (TINY_CONFIG["num_hidden_layers"], TINY_CONFIG["num_key_value_heads"])
    filters = np.ones((*shape, TINY_CONFIG["head_dim"]), np.float32) / np.sqrt(
        TINY_CONFIG["head_dim"]
    )
    config = CacheConfig(budget=64, budget_mode="adaptive")
    with pytest.raises(ValueError, match="calibrated Q-Filters"):
        make_caches(model, config)  # the fallback's scores are not comparable across heads
    with pytest.raises(ValueError, match="query scales"):
        make_caches(model, config, filters=filters)  # a version-1 calibration
    with pytest.raises(ValueError, match="calibrated Q-Filters"):
        make_caches(model, CacheConfig(method="knorm", budget=64, budget_mode="adaptive"))
    caches = make_caches(model, config, filters=filters, query_scale=np.ones(shape, np.float32))
    assert all(c.floor == config.floor_rows for c in caches)
    both = CacheConfig(budget=64, budget_mode="adaptive", chunk=8)  # the two refinements
    caches = make_caches(model, both, filters=filters, query_scale=np.ones(shape, np.float32))
    assert all((c.floor, c.chunk) == (both.floor_rows, 8) for c in caches)


def test_under_budget_generation_is_unchanged_by_adaptive_budgets():
    model = make_tiny_model(seed=1)
    shape = (TINY_CONFIG["num_hidden_layers"], TINY_CONFIG["num_key_value_heads"])
    rng = np.random.default_rng(0)
    filters = rng.standard_normal((*shape, TINY_CONFIG["head_dim"])).astype(np.float32)
    filters /= np.linalg.norm(filters, axis=-1, keepdims=True)
    prompt = mx.array(rng.integers(0, 500, (1, 150)))
    full = make_prompt_cache(model)
    adaptive = make_caches(model, CacheConfig(budget=512, budget_mode="adaptive"),
                           filters=filters, query_scale=np.ones(shape, np.float32))  # fmt: skip
    for s in range(0, 150, 50):
        want = model(prompt[:, s : s + 50], cache=full)
        got = model(prompt[:, s : s + 50], cache=adaptive)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


def test_a_floor_of_zero_holds_for_later_blocks_and_bytes_count_the_padding():
    keys = make_keys(90, seed=11)
    cache = EvictionCache(FirstComponent(), budget=BUDGET, n_sink=0, recent=0, floor=0)
    feed(cache, keys, [60])
    first = [len(p) for p in kept_positions(cache)]
    feed(cache, keys[:, :, 60:], [30])
    counts = [len(p) for p in kept_positions(cache)]
    assert sum(counts) == BUDGET * H and counts != [BUDGET] * H and min(first) < BUDGET
    stats = cache.stats()
    assert stats.tokens_kept == BUDGET  # the mean real rows per head
    S = cache.keys.shape[2]
    assert S == max(counts) and stats.kept_bytes == S * H * 2 * D * 4  # what the arrays hold


def test_chunks_with_adaptive_budgets_round_trip_through_state():
    keys = make_keys(90, seed=5)
    cache = EvictionCache(
        FirstComponent(), budget=BUDGET, n_sink=N_SINK, recent=RECENT, floor=FLOOR, chunk=4
    )
    feed(cache, keys, [60, 1, 1])
    assert cache.free is not None and cache.valid is not None and cache.positions is not None
    restored = EvictionCache.__new__(EvictionCache)
    restored.state, restored.meta_state = cache.state, cache.meta_state
    restored.scorer = cache.scorer
    assert (restored.chunk, restored.floor) == (4, FLOOR)
    for c in (cache, restored):
        feed(c, keys[:, :, 62:], [1, 1, 20, 1])
    assert kept_positions(restored) == kept_positions(cache)
    assert kept_positions(cache) == simulate(keys, [60, 1, 1, 1, 1, 20, 1], 4)
