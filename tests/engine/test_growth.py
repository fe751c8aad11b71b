"""Decode rows under the budget are written in place into buffers of ``budget + 1`` rows
(``SlotLayout._grow_row``). The reference is the same cache with that path turned off, which
appends by concatenation: every array must match it at every step, across the switch to the
slot layout, a trim and a save-and-restore."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from qfserve.engine.kv.cache import EvictionCache
from qfserve.engine.kv.scorers import KNormScorer, QFilterScorer

B, H, D, BUDGET = 2, 3, 16, 32
FIELDS = ("keys", "values", "scores", "token_scores", "positions", "order", "free")


def make(method: str, chunk: int, grows: bool) -> EvictionCache:
    filters = mx.array(np.random.default_rng(7).standard_normal((H, D)).astype(np.float32))
    scorer = QFilterScorer(filters) if method == "qfilters" else KNormScorer()
    cache = EvictionCache(scorer, budget=BUDGET, n_sink=2, recent=6, chunk=chunk)
    if not grows:
        cache._grow_row = lambda keys, values: None  # type: ignore[method-assign]
    return cache


def assert_same(got: EvictionCache, want: EvictionCache) -> None:
    assert got.offset == want.offset and got.evictions == want.evictions
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert (a is None) == (b is None), name
        if a is not None:
            np.testing.assert_array_equal(np.array(a), np.array(b), err_msg=name)


def rows(n: int, seed: int) -> list[mx.array]:
    data = np.random.default_rng(seed).standard_normal((n, B, H, 1, D)).astype(np.float32)
    return [mx.array(r) for r in data]


@pytest.mark.parametrize("method", ["qfilters", "knorm"])
@pytest.mark.parametrize("chunk", [1, 8])
def test_rows_grow_in_place_as_concatenation_appends_them(method, chunk):
    got, want = make(method, chunk, True), make(method, chunk, False)
    prompt = mx.array(np.random.default_rng(1).standard_normal((B, H, 12, D)).astype(np.float32))
    for cache in (got, want):
        cache.update_and_fetch(prompt, prompt * 2)
    for i, row in enumerate(rows(40, 2)):
        out_got = got.update_and_fetch(row, row * 2)
        out_want = want.update_and_fetch(row, row * 2)
        for a, b in zip(out_got, out_want, strict=True):
            np.testing.assert_array_equal(np.array(a), np.array(b))
        assert_same(got, want)
        filled = 12 + i + 1
        if filled <= BUDGET:  # the path under test was taken, into budget + 1 rows
            assert got._room is not None and got._room[0].shape[2] == BUDGET + 1
            assert got.nbytes == sum(a.nbytes for a in got._room[: len(got._room) // 2])
            assert got.nbytes > want.nbytes
        else:
            assert got._room is None and got.free is not None
            assert got.nbytes == want.nbytes
    assert got.size() == BUDGET and got.evictions > 0


@pytest.mark.parametrize("chunk", [1, 8])
def test_a_trim_and_a_restore_under_the_budget_start_new_buffers(chunk):
    got, want = make("qfilters", chunk, True), make("qfilters", chunk, False)
    stream = rows(45, 3)
    for row in stream[:10]:
        for cache in (got, want):
            cache.update_and_fetch(row, row)
    for cache in (got, want):
        assert cache.trim(3) == 3
    assert_same(got, want)
    restored = make("qfilters", chunk, True)
    restored.state, restored.meta_state = got.state, got.meta_state
    for row in stream[10:]:
        for cache in (restored, want):
            cache.update_and_fetch(row, row)
        assert_same(restored, want)
    assert restored.size() == BUDGET


def test_a_block_after_growth_appends_to_the_rows_grown():
    got, want = make("qfilters", 1, True), make("qfilters", 1, False)
    block = mx.array(np.random.default_rng(4).standard_normal((B, H, 9, D)).astype(np.float32))
    for cache in (got, want):
        for row in rows(5, 5):
            cache.update_and_fetch(row, row)
        cache.update_and_fetch(block, block)  # under the budget: appended whole
        for row in rows(30, 6):
            cache.update_and_fetch(row, row)
    assert_same(got, want)


def test_buffers_grow_by_steps_not_to_a_large_budget():
    """A budget far above the context reserves steps of 256 rows, not the budget."""
    scorer = QFilterScorer(mx.array(np.ones((H, D), np.float32)))
    cache = EvictionCache(scorer, budget=10**9, recent=4)
    want = EvictionCache(QFilterScorer(mx.array(np.ones((H, D), np.float32))), budget=10**9)
    want._grow_row = lambda keys, values: None  # type: ignore[method-assign]
    prompt = mx.array(np.random.default_rng(8).standard_normal((B, H, 250, D)).astype(np.float32))
    for c in (cache, want):
        c.update_and_fetch(prompt, prompt)
    sizes = []
    for row in rows(10, 9):
        for c in (cache, want):
            c.update_and_fetch(row, row)
        assert cache._room is not None
        sizes.append(cache._room[0].shape[2])
    assert sizes == [256] * 6 + [512] * 4  # 250 rows + 6 fill 256, then the next step
    np.testing.assert_array_equal(np.array(cache.keys), np.array(want.keys))
    np.testing.assert_array_equal(np.array(cache.scores), np.array(want.scores))


def test_replacing_the_rows_lets_go_of_the_buffers():
    """A trim, a restore or a packed batch lending the rows drops the growth buffers: they
    are neither held nor counted after it."""
    from qfserve.engine.kv.batch import Lent

    cache = make("qfilters", 1, True)
    for row in rows(8, 10):
        cache.update_and_fetch(row, row)
    assert cache._room is not None and cache.nbytes > sum(
        a.nbytes for a in (cache.keys, cache.values, cache.scores)
    )
    cache.trim(2)
    assert cache._room is None
    assert cache.nbytes == sum(a.nbytes for a in (cache.keys, cache.values, cache.scores))
    cache.update_and_fetch(*rows(1, 11) * 2)
    assert cache._room is not None
    cache.keys = Lent(cache.keys.shape, cache.keys.dtype)
    assert cache._room is None
