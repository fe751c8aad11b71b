"""The packed decode step against every member stepping its own cache, row for row.

Twin sets of caches receive the same prefill and the same decode rows: one set steps alone
(each cache's own ``update_and_fetch``, the reference), the other through
:class:`qfserve.engine.kv.batch.BatchCache`, which packs them (:mod:`qfserve.engine.kv.batch.packed`). Every step's
returned rows, and every member's state once given back, must be identical: same slots,
same scores, same victims, same counters.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from qfserve.engine.kv.batch import BatchCache, Lent, PackedBatch, can_pack
from qfserve.engine.kv.cache import EvictionCache, FullKVCache
from qfserve.engine.kv.scorers import KeySVDScorer, KNormScorer, QFilterScorer, RecencyScorer

H, D = 2, 8


def unit(rng, n):
    f = rng.standard_normal((n, H, D)).astype(np.float32)
    return f / np.linalg.norm(f, axis=-1, keepdims=True)


def members(seed: int):
    """Caches of every packable kind, prefilled to different states: growing, evicted by a
    block (temporal order) and already in the slot layout; one NaN key."""
    rng = np.random.default_rng(seed)
    filters = unit(rng, 3)
    specs = [
        (lambda: QFilterScorer(mx.array(filters[0])), dict(budget=12, recent=3), 7),  # grows
        (lambda: QFilterScorer(mx.array(filters[1]), sign=-1), dict(budget=10, n_sink=2), 25),
        (
            lambda: QFilterScorer(mx.array(filters[2]), query_scale=mx.array([2.0, 0.5])),
            dict(budget=9, recent=2, n_sink=1),
            40,
        ),
        (lambda: KNormScorer(), dict(budget=8, recent=2), 30),
        (lambda: RecencyScorer(), dict(budget=6, recent=0, n_sink=2), 11),
        (lambda: KeySVDScorer(calib_tokens=8), dict(budget=10, recent=2), 20),
        (None, {}, 13),  # a full cache
        # Chunked: growing to its budget, evicted by a block, and in the slot layout.
        (lambda: QFilterScorer(mx.array(filters[0])), dict(budget=12, recent=2, chunk=4), 6),
        (lambda: KNormScorer(), dict(budget=10, chunk=3, n_sink=1), 23),
        (lambda: QFilterScorer(mx.array(filters[1])), dict(budget=9, recent=2, chunk=2), 30),
    ]
    caches = []
    for make, kw, prompt in specs:
        cache = FullKVCache() if make is None else EvictionCache(make(), **kw)
        keys = mx.array(rng.standard_normal((1, H, prompt, D)).astype(np.float32))
        values = mx.array(rng.standard_normal((1, H, prompt, D)).astype(np.float32))
        cache.update_and_fetch(keys, values)
        caches.append(cache)
    # Two single rows into the streaming cache: it reaches the slot layout before packing.
    for _ in range(2):
        row = mx.array(rng.standard_normal((1, H, 1, D)).astype(np.float32))
        caches[4].update_and_fetch(row, row)
        caches[9].update_and_fetch(row, row)
    mx.eval([c.state for c in caches])
    return caches


def rows(rng, B, nan_at=None):
    k = rng.standard_normal((B, H, 1, D)).astype(np.float32)
    if nan_at is not None:
        k[nan_at, 0, 0, 0] = np.nan
    return mx.array(k), mx.array(rng.standard_normal((B, H, 1, D)).astype(np.float32))


def same(a, b):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def assert_same_state(got, ref):
    assert type(got) is type(ref)
    assert (got.offset, got.size()) == (ref.offset, ref.size())
    assert got.stats() == ref.stats()
    if isinstance(ref, FullKVCache):  # its rows; the buffers' spare capacity may differ
        for g, r in zip(got.keys_and_values(), ref.keys_and_values(), strict=True):
            same(g, r)
        return
    assert got.evictions == ref.evictions
    for name in ("keys", "values", "scores", "order", "free", "token_scores", "positions"):
        g, r = getattr(got, name), getattr(ref, name)
        assert (g is None) == (r is None), name
        if r is not None:
            same(g, r)


def test_every_step_and_every_member_match_stepping_alone():
    ref, packed = members(0), members(0)
    assert all(can_pack(c) for c in packed)
    batch = BatchCache(list(packed))
    rng = np.random.default_rng(1)
    B = len(ref)
    for step in range(14):
        keys, values = rows(rng, B, nan_at=2 if step == 3 else None)
        k, v = batch.update_and_fetch(keys, values)
        assert batch._packed is not None  # the shared-array path ran
        mask = batch.head_mask
        for i, cache in enumerate(ref):
            rk, rv = cache.update_and_fetch(keys[i : i + 1], values[i : i + 1])
            S = rk.shape[2]
            same(k[i : i + 1, :, :S], rk)  # the same rows in the same slots
            same(v[i : i + 1, :, :S], rv)
            if mask is not None:
                assert np.asarray(mask[i, 0]).tolist() == [True] * S + [False] * (k.shape[2] - S)
            else:
                assert S == k.shape[2]
            # A lent member reports what its twin holds, and holds no data of its own.
            assert packed[i].stats() == cache.stats() and packed[i].offset == cache.offset
            assert isinstance(packed[i].keys, Lent)
    assert ref[0].free is not None  # the growing members reached their budgets on the way
    assert ref[7].free is not None and ref[7].chunk == 4
    batch.filter([])  # members that leave get their rows back
    for got, want in zip(packed, ref, strict=True):
        assert_same_state(got, want)


def step_both(batch, refs, rng) -> None:
    """One decode step through the batch and through each reference alone: same rows."""
    keys, values = rows(rng, len(refs))
    k, _ = batch.update_and_fetch(keys, values)
    for i, cache in enumerate(refs):
        rk, _ = cache.update_and_fetch(keys[i : i + 1], values[i : i + 1])
        same(k[i : i + 1, :, : rk.shape[2]], rk)


def ragged_pair(seed: int):
    """Twin adaptive-budget caches with ragged heads: a member the packed step cannot take."""
    out = []
    for _ in range(2):
        cache = EvictionCache(KNormScorer(), budget=8, floor=4)
        k = mx.array(np.random.default_rng(seed).standard_normal((1, H, 20, D)).astype(np.float32))
        cache.update_and_fetch(k, k)
        out.append(cache)
    assert out[0].valid is not None and not can_pack(out[0])
    return out


def test_members_leave_and_join_the_packed_arrays_without_repacking():
    ref, packed = members(2), members(2)
    extra_ref, extra = members(3)[:2], members(3)[:2]
    late_ref, late = members(8)[7:9], members(8)[7:9]  # chunked ones, joining an unchunked batch
    odd_ref, odd = ragged_pair(9)
    batch = BatchCache(list(packed))
    rng = np.random.default_rng(4)
    live_ref, live = list(ref), list(packed)
    for step in range(16):
        before = batch._packed
        if step == 4:  # two leave (one through extract, as mlx-lm does on a finish)
            left = batch.extract(1)
            assert left is live[1] and not isinstance(left.keys, Lent)
            assert isinstance(live[0].keys, Lent)  # the others stay lent
            batch.filter([0, 2, 3, 5, 6])
            assert batch._packed is before  # the same shared arrays, one member fewer
            live_ref = [live_ref[i] for i in (0, 2, 3, 5, 6)]
            live = [live[i] for i in (0, 2, 3, 5, 6)]
        if step == 6:  # the chunked members left: the batch holds no chunk ranks any more
            assert batch._packed is not None and batch._packed.token_scores is None
        if step == 7:
            batch.extend(BatchCache(list(extra)))
            assert batch._packed is before
            live_ref, live = live_ref + extra_ref, live + extra
        if step == 9:
            batch.extend(BatchCache(list(late)))
            assert batch._packed is before and batch._packed.token_scores is not None
            live_ref, live = live_ref + late_ref, live + late
        if step == 11:  # one leaves; the chunked ones stay, their token scores gathered
            batch.filter(list(range(1, len(live))))
            assert batch._packed is before and before.token_scores is not None
            live_ref, live = live_ref[1:], live[1:]
        if step == 12:  # a member the packed step cannot take: everyone steps alone
            batch.extend(BatchCache([odd]))
            assert batch._packed is None and not isinstance(live[0].keys, Lent)
            live_ref, live = [*live_ref, odd_ref], [*live, odd]
        step_both(batch, live_ref, rng)
    batch.filter([])
    for got, want in zip(live, live_ref, strict=True):
        assert_same_state(got, want)
    for i in (1, 4, 7, 8, 9):  # those that left kept what they had then
        assert_same_state(packed[i], ref[i])


def test_a_member_extracted_but_kept_steps_on_with_the_batch():
    ref, packed = members(10), members(10)
    batch = BatchCache(list(packed))
    rng = np.random.default_rng(11)
    for step in range(6):
        if step == 3:
            assert batch.extract(2) is packed[2] and not isinstance(packed[2].keys, Lent)
        if step == 4:  # extracted again, then kept by a filter
            batch.extract(2)
            batch.filter(list(range(len(ref))))
        step_both(batch, ref, rng)  # repacks: the member is still here
        assert batch._packed is not None
    batch.filter([])
    for got, want in zip(packed, ref, strict=True):
        assert_same_state(got, want)


def test_what_cannot_be_packed_steps_alone_and_lent_arrays_refuse_work():
    ragged = ragged_pair(9)[0]  # adaptive budgets, heads ragged: not packable
    assert not can_pack(EvictionCache(KNormScorer(), budget=8))  # empty
    cold = EvictionCache(KeySVDScorer(calib_tokens=64), budget=8)
    cold.update_and_fetch(mx.ones((1, H, 4, D)), mx.ones((1, H, 4, D)))
    assert not can_pack(cold)  # the fallback has no direction yet
    batch = BatchCache([*members(5)[:2], ragged])
    batch.update_and_fetch(*rows(np.random.default_rng(0), 3))
    assert batch._packed is None
    with pytest.raises(ValueError, match="packable"):
        PackedBatch([ragged])
    lent = members(6)
    BatchCache(lent).update_and_fetch(*rows(np.random.default_rng(0), len(lent)))
    with pytest.raises((TypeError, ValueError)):
        lent[0].update_and_fetch(mx.ones((1, H, 1, D)), mx.ones((1, H, 1, D)))


def test_a_huge_budget_reserves_only_what_its_rows_need():
    big = EvictionCache(KNormScorer(), budget=10**12)
    big.update_and_fetch(mx.ones((1, H, 5, D)), mx.ones((1, H, 5, D)))
    batch = BatchCache([big, *members(7)[:2]])
    k, _ = batch.update_and_fetch(*rows(np.random.default_rng(0), 3))
    packed = batch._packed
    assert packed is not None and packed.keys.shape[2] == 256  # one growth step, not 10**12
    assert (
        k.shape[2] == max(r.held for r in packed.rows) < 256
    )  # attention reads only the slots held


@pytest.mark.parametrize("chunk", [1, 4])
def test_a_growing_batch_evaluates_each_step_with_the_next(chunk):
    """Evaluating what a step returns (as generation does) evaluates the step before it
    whole: a growing member's scores and order do not wait, lazily chained step on step,
    for the end of the request (they once took ~100 ms to give back, 30 layers, 60 steps)."""
    import re
    import tempfile
    from pathlib import Path

    scorer = QFilterScorer(mx.array(unit(np.random.default_rng(3), 1)[0]))
    cache = EvictionCache(scorer, budget=200, recent=4, chunk=chunk)
    rows = mx.array(np.random.default_rng(4).standard_normal((1, H, 6, D)).astype(np.float32))
    cache.update_and_fetch(rows, rows)
    batch = BatchCache([cache])
    for _ in range(30):
        new = mx.random.normal((1, H, 1, D))
        mx.eval(batch.update_and_fetch(new, new))
    packed = batch._packed
    assert packed is not None and packed.rows[0].held < packed.rows[0].cap  # still growing
    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, packed.scores, packed.order)
        ops = re.findall(r'label ="?([A-Za-z]+)', Path(f.name).read_text())
    assert len(ops) <= 12, ops  # the last step's graph, not thirty
