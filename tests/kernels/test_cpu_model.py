"""The numpy model of the apply kernel against a stable-argsort oracle, on adversarial inputs."""

from __future__ import annotations

import numpy as np
import pytest

from qfserve.kernels.cpu_model import fused_evict_model, threadgroup_keep_rows, threshold
from qfserve.kernels.sources import DEFAULT_THREADS
from tests.kernels._reference import KINDS, argsort_keep, make_scores


def check(scores: np.ndarray, budget: int, n_sink: int, recent: int, threads: int) -> None:
    G, L = scores.shape
    rng = np.random.default_rng(L * 31 + budget)
    keys = rng.standard_normal((G, L, 3)).astype(np.float16)
    values = rng.standard_normal((G, L, 2)).astype(np.float32)
    k, v, s = fused_evict_model(
        keys, values, scores, budget=budget, n_sink=n_sink, recent=recent, threads=threads
    )
    want = argsort_keep(scores, budget, n_sink, recent)
    take = np.arange(G)[:, None]
    assert k.shape == (G, budget, 3) and v.shape == (G, budget, 2) and s.shape == (G, budget)
    np.testing.assert_array_equal(k.view(np.uint16), keys[take, want].view(np.uint16))
    np.testing.assert_array_equal(v.view(np.uint32), values[take, want].view(np.uint32))
    np.testing.assert_array_equal(s.view(np.uint32), scores[take, want].view(np.uint32))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("threads", [1, 7, 32, DEFAULT_THREADS])
def test_every_score_pattern_and_threadgroup_size(kind, threads):
    rng = np.random.default_rng(threads)
    check(make_scores(rng, (3, 101), kind), budget=40, n_sink=2, recent=5, threads=threads)


def test_all_scores_tie():
    # The threshold equals every row: only the quota decides, lowest rows first.
    scores = np.zeros((2, 70), dtype=np.float32)
    check(scores, budget=25, n_sink=0, recent=0, threads=32)
    check(scores, budget=25, n_sink=3, recent=4, threads=32)


@pytest.mark.parametrize("n_sink, recent", [(70, 0), (0, 70), (40, 40), (100, 100)])
def test_all_rows_protected_tie_at_infinity(n_sink, recent):
    scores = make_scores(np.random.default_rng(0), (2, 70), "random")
    check(scores, budget=30, n_sink=n_sink, recent=recent, threads=32)


@pytest.mark.parametrize("kind", KINDS)
def test_budget_equals_rows(kind):
    scores = make_scores(np.random.default_rng(1), (2, 45), kind)
    check(scores, budget=45, n_sink=2, recent=3, threads=16)


@pytest.mark.parametrize("kind", ["random", "ties", "constant"])
def test_budget_one_above_protection(kind):
    n_sink, recent = 4, 9
    scores = make_scores(np.random.default_rng(2), (3, 90), kind)
    check(scores, budget=n_sink + recent + 1, n_sink=n_sink, recent=recent, threads=32)


@pytest.mark.parametrize("groups", [1, 2, 5, 17, 64])
def test_one_to_sixty_four_groups(groups):
    scores = make_scores(np.random.default_rng(groups), (groups, 50), "ties")
    check(scores, budget=20, n_sink=1, recent=2, threads=16)


@pytest.mark.parametrize("L", [1, 15, 31, 33, 257, 300])
def test_rows_not_a_multiple_of_the_threadgroup(L):
    # Includes threadgroups wider than the group (idle threads with empty runs).
    scores = make_scores(np.random.default_rng(L), (2, L), "ties")
    budget = max(1, L // 3)
    check(scores, budget=budget, n_sink=min(1, budget - 1), recent=0, threads=32)
    check(scores, budget=budget, n_sink=0, recent=0, threads=DEFAULT_THREADS)


def test_random_sweep():
    rng = np.random.default_rng(1234)
    for _ in range(60):
        L = int(rng.integers(1, 200))
        budget = int(rng.integers(1, L + 1))
        n_sink = int(rng.integers(0, 6))
        recent = int(rng.integers(0, 12))
        threads = int(rng.choice([1, 3, 8, 32, 64]))
        kind = str(rng.choice(KINDS))
        scores = make_scores(rng, (int(rng.integers(1, 4)), L), kind)
        check(scores, budget, n_sink, recent, threads)


def test_a_threshold_not_taken_from_the_scores_breaks_the_invariant():
    # The kernel relies on the host threshold having >= budget rows at or above it.
    scores = np.arange(10, dtype=np.float32)
    with pytest.raises(RuntimeError, match="never written"):
        threadgroup_keep_rows(scores, np.float32(100), budget=4, n_sink=0, recent=0, threads=4)


def test_threshold_is_the_budget_th_largest_ranked_score():
    scores = np.array([[5, 1, 4, 2, 3, 0]], dtype=np.float32)
    assert threshold(scores, budget=2, n_sink=0, recent=0)[0] == 4
    # Row 0 and row 5 protected: +inf, +inf, then 4 is the third largest.
    assert threshold(scores, budget=3, n_sink=1, recent=1)[0] == 4
    assert threshold(scores, budget=2, n_sink=1, recent=1)[0] == np.inf
