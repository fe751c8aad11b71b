"""SnapKV and TOVA caches against a numpy simulation of each method on the same rows.

Keys and queries are random; the query tap is fed by hand as a layer's rope would feed it.
The reference keeps a list of (position, key) rows and applies each method's rule with
numpy (softmax attention, window votes, average pooling, top-k with sinks and the recent
window protected, the lowest row evicted at each step), independently of the engine's
eviction core.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from qfserve.engine.kv.cache import EvictionCache
from qfserve.engine.kv.config import CacheConfig, ConfigError
from qfserve.engine.kv.query_aware import DEFAULT_KERNEL, SnapKVScorer, TOVAScorer
from qfserve.engine.kv.selfcal import QueryTap

H, G, D = 2, 2, 8  # KV heads, query heads per KV head, head_dim
SCALE = D**-0.5


def weights(q: np.ndarray, k: np.ndarray) -> np.ndarray:
    """(H, W, S): softmax attention of (H*G, W, D) queries over (H, S, D) keys, group mean."""
    q = q.reshape(H, G, *q.shape[1:])
    logits = np.einsum("hgwd,hsd->hgws", q, k) * SCALE
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)).mean(1)


def snapkv_scores(q: np.ndarray, k: np.ndarray, window: int) -> np.ndarray:
    N = k.shape[1]
    w = min(window, N)
    att = weights(q[:, N - w :], k)  # (H, w, N)
    for j in range(w):
        att[:, j, N - w + j + 1 :] = 0.0  # window query j does not see later keys
    votes = att.mean(1)
    half = DEFAULT_KERNEL // 2
    padded = np.pad(votes, [(0, 0), (half, half)])
    return np.stack([padded[:, i : i + N] for i in range(DEFAULT_KERNEL)]).mean(0)


def top_rows(scores: np.ndarray, budget: int, n_sink: int, recent: int) -> list[list[int]]:
    """Per head, the kept row indices: protected rows, then the best scores (lowest
    position first among ties)."""
    L = scores.shape[1]
    out = []
    for h in range(H):
        rank = scores[h].copy()
        rank[:n_sink] = np.inf
        if recent:
            rank[L - recent :] = np.inf
        out.append(sorted(np.lexsort((np.arange(L), -rank))[:budget].tolist()))
    return out


def kept_positions(cache: EvictionCache, keys_by_pos: np.ndarray) -> list[list[int]]:
    """Positions of the rows a cache holds, found by matching their keys."""
    kept, _, _ = cache.kept()
    kept = np.array(kept[0])  # (H, S, D)
    out = []
    for h in range(H):
        pos = [int(np.flatnonzero((keys_by_pos[h] == row).all(-1))[0]) for row in kept[h]]
        out.append(sorted(pos))
    return out


def feed(cache, tap, q, k):
    tap(mx.array(q[None]), 0)  # as the layer's rope would, just before the cache update
    cache.update_and_fetch(mx.array(k[None]), mx.array(k[None]))


@pytest.mark.parametrize("recent", [0, 3])
def test_tova_evicts_the_row_the_newest_query_attends_to_least(recent):
    rng = np.random.default_rng(recent)
    budget, n_sink, prompt, steps = 12, 2, 30, 15
    L = prompt + steps
    keys = rng.standard_normal((H, L, D)).astype(np.float32) * 2
    queries = rng.standard_normal((H * G, L, D)).astype(np.float32) * 2
    tap = QueryTap(SCALE)
    cache = EvictionCache(TOVAScorer(tap, scale=SCALE), budget=budget, n_sink=n_sink, recent=recent)
    feed(cache, tap, queries[:, :prompt], keys[:, :prompt])
    # The block: top rows by its last query's attention over every row.
    att = weights(queries[:, prompt - 1 : prompt], keys[:, :prompt])[:, 0]
    want = top_rows(att, budget, n_sink, recent)
    assert kept_positions(cache, keys) == want
    for t in range(prompt, L):
        feed(cache, tap, queries[:, t : t + 1], keys[:, t : t + 1])
        for h in range(H):  # each step: the newest query's least attended row goes
            rows = [*want[h], t]
            a = weights(queries[:, t : t + 1], keys[:, rows])[h, 0]
            guarded = [p < n_sink or p > t - recent for p in rows]
            a = np.where(guarded, np.inf, a)
            want[h] = sorted(r for i, r in enumerate(rows) if i != int(np.argmin(a)))
        assert kept_positions(cache, keys) == want, t


def test_snapkv_keeps_what_the_window_votes_for_then_decodes_into_its_recent_rows():
    rng = np.random.default_rng(5)
    budget, n_sink, recent, window, prompt = 16, 2, 4, 8, 40
    keys = rng.standard_normal((H, prompt + 10, D)).astype(np.float32) * 2
    queries = rng.standard_normal((H * G, prompt + 10, D)).astype(np.float32) * 2
    tap = QueryTap(SCALE)
    scorer = SnapKVScorer(tap, scale=SCALE, window=window)
    cache = EvictionCache(scorer, budget=budget, n_sink=n_sink, recent=recent)
    scores = snapkv_scores(queries[:, :prompt], keys[:, :prompt], window)
    tap(mx.array(queries[None, :, :prompt]), 0)
    got = scorer.score(mx.array(keys[None, :, :prompt]), 0)[0]
    np.testing.assert_allclose(np.array(got), scores, rtol=1e-5, atol=1e-7)
    feed(cache, tap, queries[:, :prompt], keys[:, :prompt])
    want = top_rows(scores, budget, n_sink, recent)
    assert kept_positions(cache, keys) == want
    for t in range(prompt, prompt + 10):
        feed(cache, tap, queries[:, t : t + 1], keys[:, t : t + 1])
    # Generated rows rank below every prompt row: the selected prompt rows outside the
    # recent window stay, and the window holds the latest rows.
    got = kept_positions(cache, keys)
    for h in range(H):
        old = [p for p in want[h] if p < prompt - recent]
        assert got[h] == sorted(old + list(range(prompt + 10 - (budget - len(old)), prompt + 10)))


def test_a_block_fed_without_its_queries_is_a_clear_error():
    tap = QueryTap(SCALE)
    cache = EvictionCache(SnapKVScorer(tap, scale=SCALE), budget=8)
    with pytest.raises(RuntimeError, match="query tap"):
        cache.update_and_fetch(mx.ones((1, H, 12, D)), mx.ones((1, H, 12, D)))


@pytest.mark.parametrize("method", ["snapkv", "tova"])
def test_query_aware_methods_refuse_chunks_and_adaptive_budgets(method):
    with pytest.raises(ConfigError, match="chunk") as e:
        CacheConfig(method=method, budget=64, chunk=4)
    assert e.value.param == "chunk"
    with pytest.raises(ConfigError) as e:
        CacheConfig(method=method, budget=64, budget_mode="adaptive")
    assert e.value.param == "budget_mode"
