"""Head-adaptive selection against an independent numpy reference: floors first, then one
top-k over the layer; every head keeps at least its floor and the layer exactly budget * H."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from qfserve.engine.kv.adaptive import exactly_k, ragged_gather, select_adaptive


def ref_adaptive(scores, budget, n_sink, recent, floor, eligible=None, cap=None):
    """Per batch row: each head's floor (protected first, score desc, position asc), then
    the layer's best remaining rows by expected log attention weight, each head's scores less
    their log-sum-exp over its eligible rows (weight desc, head asc, position asc); with a
    ``cap``, only each head's first ``cap`` rows in its own order take part."""
    B, H, L = scores.shape
    eligible = np.ones(scores.shape, bool) if eligible is None else eligible.copy()
    keep = np.zeros(scores.shape, bool)
    s = np.where(np.isnan(scores), -np.inf, scores.astype(np.float64))
    for b in range(B):
        for h in range(H):
            real = s[b, h][eligible[b, h] & np.isfinite(s[b, h])]
            if real.size:
                top = real.max()
                s[b, h] -= top + np.log(np.exp(real - top).sum())
    for b in range(B):
        for h in range(H):
            rows = [r for r in range(L) if eligible[b, h, r]]
            # Sinks and recent rows: the head's first and last real rows.
            prot = set(rows[:n_sink]) | set(rows[len(rows) - recent :] if recent else [])
            rows.sort(key=lambda r: (r not in prot, -s[b, h, r], r))
            keep[b, h, rows[:floor]] = True
            if cap is not None:
                eligible[b, h, rows[cap:]] = False
        rest = [
            (h, r) for h in range(H) for r in range(L) if eligible[b, h, r] and not keep[b, h, r]
        ]
        rest.sort(key=lambda hr: (-s[b, hr[0], hr[1]], hr[0], hr[1]))
        for h, r in rest[: (budget - floor) * H]:
            keep[b, h, r] = True
    return keep


def test_exactly_k_matches_a_stable_numpy_top_k():
    rng = np.random.default_rng(0)
    ranked = rng.integers(0, 5, (6, 40)).astype(np.float32)  # many ties
    ranked[0, :5] = -np.inf
    k = rng.integers(0, 41, (6, 1)).astype(np.int32)
    got = np.array(exactly_k(mx.array(ranked), mx.array(k)))
    for g in range(6):
        order = np.lexsort((np.arange(40), -ranked[g]))
        want = np.zeros(40, bool)
        want[order[: k[g, 0]]] = True
        np.testing.assert_array_equal(got[g], want)


@pytest.mark.parametrize(
    ("budget", "n_sink", "recent", "floor"),
    [(16, 4, 0, 4), (16, 2, 4, 8), (20, 0, 0, 1), (12, 4, 4, 12), (24, 4, 6, 10)],
)
def test_select_adaptive_matches_the_reference(budget, n_sink, recent, floor):
    rng = np.random.default_rng(budget + floor)
    B, H, L = 2, 3, 64
    # Heads on different scales, so the shared top-k really moves rows between heads.
    scores = rng.standard_normal((B, H, L)).astype(np.float32) * np.array([0.2, 1.0, 3.0])[:, None]
    scores[0, 1, 7] = np.nan
    keep, counts = select_adaptive(
        mx.array(scores), budget=budget, n_sink=n_sink, recent=recent, floor=floor
    )
    keep, counts = np.array(keep), np.array(counts)
    np.testing.assert_array_equal(keep, ref_adaptive(scores, budget, n_sink, recent, floor))
    assert (counts.sum(-1) == budget * H).all() and (counts >= floor).all()
    assert keep[..., :n_sink].all() and keep[..., L - recent :].all()
    if floor < budget:
        assert counts.max() > budget  # the large-scale head took rows
    else:
        assert (counts == budget).all()  # a floor of the whole budget is per-head eviction


@pytest.mark.parametrize("floor", [4, 6])
def test_a_cap_bounds_every_head_and_the_rest_go_to_the_next_best(floor):
    """The layer's storage is padded to its longest head: under a cap, a head whose rows
    would win most of the layer keeps its best ``cap`` and the other heads take the rest."""
    rng = np.random.default_rng(floor)
    B, H, L, budget, cap = 2, 3, 64, 16, 18
    scores = rng.standard_normal((B, H, L)).astype(np.float32) * np.array([0.2, 1.0, 3.0])[:, None]
    free, _ = select_adaptive(mx.array(scores), budget=budget, n_sink=4, recent=0, floor=floor)
    assert np.array(free).sum(-1).max() > cap  # uncapped, the large-scale head goes past it
    keep, counts = select_adaptive(
        mx.array(scores), budget=budget, n_sink=4, recent=0, floor=floor, cap=cap
    )
    keep, counts = np.array(keep), np.array(counts)
    np.testing.assert_array_equal(keep, ref_adaptive(scores, budget, 4, 0, floor, cap=cap))
    assert (counts.sum(-1) == budget * H).all() and counts.max() == cap


def test_a_cap_that_leaves_too_few_rows_keeps_fewer_never_padding():
    scores = np.zeros((1, 2, 8), np.float32)
    eligible = np.ones((1, 2, 8), bool)
    eligible[0, 1, 3:] = False  # the second head holds 3 real rows
    keep, counts = select_adaptive(
        mx.array(scores), budget=6, n_sink=0, recent=0, floor=1,
        eligible=mx.array(eligible), cap=4,
    )  # fmt: skip
    keep = np.array(keep)
    assert not keep[~eligible].any() and np.array(counts).tolist() == [[4, 3]]


def test_padding_rows_are_never_kept():
    rng = np.random.default_rng(3)
    B, H, L = 1, 3, 50
    scores = rng.standard_normal((B, H, L)).astype(np.float32)
    eligible = np.ones((B, H, L), bool)
    eligible[0, 0, 40:48] = False  # padding of a head that kept fewer rows, before the block
    scores[0, 0, 40:48] = 100.0  # whatever sits in padding must not matter
    keep, counts = select_adaptive(
        mx.array(scores), budget=12, n_sink=2, recent=3, floor=6, eligible=mx.array(eligible)
    )
    keep = np.array(keep)
    assert not keep[~eligible].any()
    assert keep[0, 0, [39, 48, 49]].all()  # head 0's last real rows are its recent window
    np.testing.assert_array_equal(keep, ref_adaptive(scores, 12, 2, 3, 6, eligible))
    assert int(np.array(counts).sum()) == 12 * H


def test_ragged_gather_keeps_temporal_order_and_marks_padding():
    keep = np.zeros((1, 2, 10), bool)
    keep[0, 0, [1, 4, 5]] = True
    keep[0, 1, [0, 2, 3, 8, 9]] = True
    idx, valid = ragged_gather(mx.array(keep), mx.array(keep.sum(-1).astype(np.int32)))
    idx, valid = np.array(idx), np.array(valid)
    assert idx.shape == (1, 2, 5)
    np.testing.assert_array_equal(idx[0, 0, :3], [1, 4, 5])
    np.testing.assert_array_equal(idx[0, 1], [0, 2, 3, 8, 9])
    np.testing.assert_array_equal(valid, [[[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]])


def test_floor_outside_its_range_is_refused():
    scores = mx.zeros((1, 2, 30))
    with pytest.raises(ValueError, match="floor must be in"):
        select_adaptive(scores, budget=10, n_sink=4, recent=4, floor=6)
    with pytest.raises(ValueError, match="floor must be in"):
        select_adaptive(scores, budget=10, n_sink=0, recent=0, floor=11)


def test_the_shared_rows_go_where_attention_concentrates_not_where_logits_run_high():
    """Head 0's logits are all high and flat (its attention is spread over every row); head
    1's are lower but peaked on 8 rows. Softmax normalises each head, so those 8 rows carry
    far more of their head's attention than any row of head 0 does, and they are kept first,
    although every one of head 0's raw logits is larger."""
    L, budget, floor = 64, 12, 2
    scores = np.full((1, 2, L), -10.0, np.float32)
    scores[0, 0] = 10.0 + np.linspace(0, 0.01, L)
    peaks = np.arange(5, 61, 7)  # 8 rows
    scores[0, 1, peaks] = 9.0
    keep, counts = select_adaptive(mx.array(scores), budget=budget, n_sink=0, recent=0, floor=floor)
    keep = np.array(keep)
    assert keep[0, 1, peaks].all()
    assert np.array(counts).tolist() == [[budget * 2 - 8, 8]]
