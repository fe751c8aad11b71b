"""The eviction core and every scorer against an independent numpy ranking."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from qfserve.engine.kv.cache import EvictionCache
from qfserve.engine.kv.evict import select_keep, select_victim
from qfserve.engine.kv.scorers import KNormScorer, QFilterScorer, RecencyScorer

B, H, D = 2, 2, 16


def numpy_keep(scores: np.ndarray, budget: int, n_sink: int, recent: int) -> np.ndarray:
    """Reference: top-``budget`` rows per (b, h), protected rows forced, ties to lower rows.

    Returns a ``(B, H, L)`` boolean keep mask.
    """
    *lead, L = scores.shape
    keep = np.zeros(scores.shape, dtype=bool)
    if L <= budget:
        return ~keep
    for idx in np.ndindex(*lead):
        s = scores[idx].astype(np.float64)
        rows = np.arange(L)
        protected = (rows < n_sink) | (rows >= L - recent)
        # lexsort: last key is primary. Protected first, then score desc, then position asc.
        order = np.lexsort((rows, -s, ~protected))
        keep[idx][order[:budget]] = True
    return keep


def run_cache(cache: EvictionCache, keys: np.ndarray, values: np.ndarray, chunk: int):
    L = keys.shape[2]
    for s in range(0, L, chunk):
        cache.update_and_fetch(
            mx.array(keys[:, :, s : s + chunk]), mx.array(values[:, :, s : s + chunk])
        )
        assert cache.size() <= max(cache.budget, 0) or not cache.scorer.ready
    kept_keys, kept_values, _ = cache.kept()
    return np.array(kept_keys), np.array(kept_values)


def reference_scores(method: str, keys: np.ndarray, filters: np.ndarray) -> np.ndarray:
    k = keys.astype(np.float64)
    if method == "qfilters":
        return np.einsum("bhld,hd->bhl", k, filters)
    if method == "knorm":
        return -np.linalg.norm(k, axis=-1)
    return np.broadcast_to(np.arange(keys.shape[2], dtype=np.float64), keys.shape[:3])


def make_scorer(method: str, filters: np.ndarray):
    return {
        "qfilters": lambda: QFilterScorer(mx.array(filters)),
        "knorm": KNormScorer,
        "streaming": RecencyScorer,
    }[method]()


@pytest.mark.parametrize("method", ["qfilters", "knorm", "streaming"])
@pytest.mark.parametrize("chunk", [1, 7, 300])
@pytest.mark.parametrize(("budget", "n_sink", "recent"), [(32, 4, 0), (48, 2, 12), (6, 1, 4)])
def test_kept_rows_match_numpy_ranking(method, chunk, budget, n_sink, recent):
    rng = np.random.default_rng(0)
    L = 300
    keys = rng.standard_normal((B, H, L, D)).astype(np.float32)
    values = rng.standard_normal((B, H, L, D)).astype(np.float32)
    filters = rng.standard_normal((H, D)).astype(np.float32)
    filters /= np.linalg.norm(filters, axis=-1, keepdims=True)

    cache = EvictionCache(make_scorer(method, filters), budget=budget, n_sink=n_sink, recent=recent)
    got_k, got_v = run_cache(cache, keys, values, chunk)

    keep = numpy_keep(reference_scores(method, keys, filters), budget, n_sink, recent)
    for b in range(B):
        for h in range(H):
            np.testing.assert_array_equal(got_k[b, h], keys[b, h][keep[b, h]])
            np.testing.assert_array_equal(got_v[b, h], values[b, h][keep[b, h]])
    assert cache.offset == L
    assert cache.size() == budget


def test_ties_keep_lower_positions_and_never_overflow():
    # Every key has the same norm: all K-norm scores tie.
    L, budget, n_sink, recent = 50, 20, 3, 5
    keys = np.zeros((B, H, L, D), np.float32)
    keys[..., 0] = 1.0
    values = np.arange(L, dtype=np.float32)[None, None, :, None] * np.ones((B, H, L, D), np.float32)
    for chunk in (1, 9, L):
        cache = EvictionCache(KNormScorer(), budget=budget, n_sink=n_sink, recent=recent)
        _, got_v = run_cache(cache, keys, values, chunk)
        positions = got_v[0, 0, :, 0].astype(int).tolist()
        assert positions == list(range(budget - recent)) + list(range(L - recent, L))


@pytest.mark.parametrize("L", [9, 33, 130])
def test_victim_matches_general_path_in_any_slot_order(L):
    rng = np.random.default_rng(L)
    # Coarse integer scores force many ties, including at the minimum.
    scores = rng.integers(0, 4, size=(3, 5, L)).astype(np.float32)
    for n_sink, recent in [(0, 0), (2, 3), (4, 0)]:
        general = np.array(select_keep(mx.array(scores), L - 1, n_sink, recent))
        # Shuffle the non-sink slots: the victim is found by rank in time, not by slot.
        perm = np.concatenate([np.arange(n_sink), n_sink + rng.permutation(L - n_sink)])
        order = np.broadcast_to(perm, scores.shape).astype(np.int32)  # slot -> time rank
        slotted = np.empty_like(scores)
        np.put_along_axis(slotted, order.astype(np.int64), scores, axis=-1)
        slot = np.array(
            select_victim(
                mx.array(slotted),
                mx.array(np.argsort(order, -1).astype(np.int32)),
                n_sink,
                L - recent,
            )
        )[..., 0]
        time_of_slot = np.argsort(order, -1)
        for idx in np.ndindex(3, 5):
            dropped = time_of_slot[idx][slot[idx]]
            assert sorted(set(range(L)) - {dropped}) == general[idx].tolist()


def test_all_protected_but_one_slot():
    # budget = n_sink + recent + 1: a single free slot, won by the best unprotected row.
    rng = np.random.default_rng(3)
    L, n_sink, recent = 40, 4, 6
    scores = rng.standard_normal((1, 2, L)).astype(np.float32)
    keep = np.array(select_keep(mx.array(scores), n_sink + recent + 1, n_sink, recent))
    ref = numpy_keep(scores, n_sink + recent + 1, n_sink, recent)
    for h in range(2):
        np.testing.assert_array_equal(keep[0, h], np.flatnonzero(ref[0, h]))


@pytest.mark.parametrize("chunk", [1, 7, 20])
def test_nan_keys_are_dropped_first_and_budget_holds(chunk):
    L, budget = 20, 8
    keys = np.random.default_rng(1).standard_normal((1, 1, L, D)).astype(np.float32)
    keys[0, 0, 10] = np.nan
    cache = EvictionCache(KNormScorer(), budget=budget, n_sink=2)
    got_k, _ = run_cache(cache, keys, keys, chunk)
    assert got_k.shape[2] == budget
    assert not np.isnan(got_k).any()


def test_nan_key_in_a_protected_sink_does_not_break_the_budget():
    L, budget = 30, 10
    keys = np.random.default_rng(2).standard_normal((1, 1, L, D)).astype(np.float32)
    keys[0, 0, 0] = np.nan  # a sink
    for chunk in (1, L):
        cache = EvictionCache(KNormScorer(), budget=budget, n_sink=2, recent=3)
        got_k, _ = run_cache(cache, keys, keys, chunk)
        assert got_k.shape[2] == budget
        assert np.isnan(got_k[0, 0, 0]).all()  # sinks are kept whatever they hold


@pytest.mark.parametrize("ranked", [True, False])
def test_the_compiled_decode_step_keeps_nothing_per_shape(ranked):
    # mx.compile keeps a trace's constants for the process's life: a step compiled for each
    # batch shape a server meets must not hold memory for each (the disconnect storm's check).
    from qfserve.engine.kv.evict import write_and_select

    def step(B: int) -> None:
        H, C, D = 2, 17, 8
        cols = mx.zeros((B, H, C), dtype=mx.int32)
        out = write_and_select(
            mx.zeros((B, H, C, D)),
            mx.zeros((B, H, C, D)),
            mx.zeros((B, H, C)),
            cols + mx.arange(C, dtype=mx.int32),
            mx.zeros((B, H, 1), dtype=mx.uint32),
            (mx.zeros((B, H, 1, D)), mx.zeros((B, H, 1, D)), mx.full((B, H, 1), np.nan)),
            mx.array(C, dtype=mx.int32),
            mx.array(C - 2, dtype=mx.int32),
            mx.array(1, dtype=mx.int32),
            None if ranked else mx.full((B, 1, 1), C, dtype=mx.int32),
            ranked=ranked,
        )
        mx.eval(out)
        assert np.all(np.array(out[4]) >= 1)  # never a sink

    step(1)
    mx.clear_cache()
    before = mx.get_active_memory()
    for B in (2, 3, 5, 2):
        step(B)
    mx.clear_cache()
    assert mx.get_active_memory() == before


@pytest.mark.parametrize("method", ["qfilters", "knorm", "streaming"])
@pytest.mark.parametrize("chunk", [1, 4])
def test_the_native_step_keeps_the_rows_mlx_keeps(method, chunk):
    """A tiny model decoding 40 steps past its budget, alone and in a packed batch of two
    (growing, then at the budget; chunked caches with their per-token scores): with the
    native eviction step, the same tokens, rows and positions as with MLX's."""
    from qfserve.engine.kv import attention
    from qfserve.engine.kv.batch import BatchCache
    from qfserve.engine.kv.config import CacheConfig
    from qfserve.engine.kv.factory import make_caches
    from qfserve.engine.models.gguf.convert import cache_root
    from qfserve.kernels import native
    from tests.tiny import make_tiny_model

    kernel = native.load(cache_root() / "native")
    if kernel is None:
        pytest.skip("the native kernels do not build here")
    model = make_tiny_model()
    attn = model.layers[0].self_attn
    shape = (len(model.layers), attn.n_kv_heads, attn.head_dim)
    filters = mx.array(np.random.default_rng(1).standard_normal(shape).astype(np.float32))
    # Prompts under the budget: the members grow, then evict.
    config = CacheConfig(method=method, budget=32, recent=6, n_sink=2, chunk=chunk)
    prompts = [[5, 9, 3, 7, 1, 2, 8] * 3, [4, 4, 6, 1, 9] * 5]

    def run(batched: bool) -> tuple[list, list]:
        members = [make_caches(model, config, filters=filters if method == "qfilters" else None)
                   for _ in prompts]  # fmt: skip
        for caches, prompt in zip(members, prompts, strict=True):
            mx.eval(model(mx.array([prompt]), cache=caches))
        runs = [members] if batched else [[c] for c in members]
        out = []
        for group in runs:
            layers = [BatchCache([m[i] for m in group]) for i in range(len(model.layers))]
            y = mx.array([[p[-1]] for p in prompts[: len(group)]] if batched else [[3]])
            tokens = []
            for _ in range(40):
                y = mx.argmax(model(y, cache=layers)[:, -1], axis=-1)[:, None]
                tokens.append(np.array(y).ravel().tolist())
            for layer in layers:
                layer.filter([])  # members take their rows back
            out.append(tokens)
        rows = [(np.array(c.keys), np.array(c.positions if c.tracks else c.order),
                 None if c.token_scores is None else np.array(c.token_scores))
                for m in members for c in m]  # fmt: skip
        return out, rows

    class Counting:  # the kernel module, its eviction steps counted
        steps = 0

        def __getattr__(self, name):
            return getattr(kernel, name)

        def evict_step(self, *args, **kwargs):
            Counting.steps += 1
            return kernel.evict_step(*args, **kwargs)

    results = {}
    try:
        for arm in ("mlx", "native"):
            attention.set_native(Counting() if arm == "native" else None)
            results[arm] = (run(False), run(True))
    finally:
        attention.set_native(None)
    assert Counting.steps > 0
    for (tokens_n, rows_n), (tokens_m, rows_m) in zip(
        results["native"], results["mlx"], strict=True
    ):
        assert tokens_n == tokens_m
        for (keys_n, pos_n, tok_n), (keys_m, pos_m, tok_m) in zip(rows_n, rows_m, strict=True):
            np.testing.assert_array_equal(pos_n, pos_m)
            np.testing.assert_allclose(keys_n, keys_m, rtol=1e-5, atol=1e-5)
            assert (tok_n is None) == (tok_m is None) == (chunk == 1)
            if tok_n is not None:
                np.testing.assert_allclose(tok_n, tok_m, rtol=1e-5, atol=1e-5)
