"""KVzap's threshold: rows outside the sinks and the recent window scoring below it are
evicted, the budget the cap. The kept rows against a numpy simulation of the rule on the
surrogate's numpy scores (each layer holds the most rows any head keeps, each head its best),
for a prompt read as one block and for decode steps (a compaction every
``THRESHOLD_EVERY`` rows), and the settings' refusals."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from qfserve.engine.kv.cache import THRESHOLD_EVERY
from qfserve.engine.kv.config import CacheConfig, ConfigError
from qfserve.engine.kv.factory import make_caches
from tests.engine.test_kvzap import (
    kept_positions,
    layer_inputs,
    numpy_forward,
    random_surrogate,
)
from tests.tiny import make_tiny_model

TOKENS = [int(t) for t in np.random.default_rng(1).integers(20, 500, size=64)]
N_SINK, RECENT = 2, 4


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=3)


@pytest.fixture(scope="module")
def surrogate():
    return random_surrogate("linear", seed=4)


def scores_of(model, surrogate, tokens):
    """Per layer, ``(H, T)``: the surrogate's numpy scores of every row."""
    inputs = layer_inputs(model, tokens)
    w, b = surrogate.weights["w"], surrogate.weights["b"]
    return [numpy_forward(x[0], (w[i], b[i])).T for i, x in enumerate(inputs)]


def threshold_keep(scores, held, offset, threshold, budget):
    """The rule on the rows ``held`` (per head, positions in time): each head's protected
    rows and those at or above the threshold; the layer keeps the most any head keeps (at
    most the budget, one more than the protected rows at least), each head its best."""
    counts = []
    for h, rows in enumerate(held):
        guarded = [p < N_SINK or p >= offset - RECENT for p in rows]
        counts.append(
            sum(g or scores[h, p] >= threshold for p, g in zip(rows, guarded, strict=True))
        )
    k = max(N_SINK + RECENT + 1, min(budget, max(counts)))
    if k >= len(held[0]):
        return held
    out = []
    for h, rows in enumerate(held):
        local = np.array([scores[h, p] for p in rows])[None]
        guarded_local = numpy_keep_guarded(local, rows, offset)
        out.append(sorted(rows[j] for j in guarded_local[:k]))
    return out


def numpy_keep_guarded(local, rows, offset):
    """Indices into ``rows``, best first: protected rows, then by score, the earlier first."""
    ranked = [
        (np.inf if p < N_SINK or p >= offset - RECENT else local[0, j], -p, j)
        for j, p in enumerate(rows)
    ]
    return [j for *_, j in sorted(ranked, reverse=True)]


def pick_threshold(layer_scores, quantile):
    return float(np.quantile(np.concatenate([s.ravel() for s in layer_scores]), quantile))


@pytest.mark.parametrize("quantile", [0.6, 0.9])
def test_a_prompt_keeps_what_the_threshold_keeps(model, surrogate, quantile):
    prompt = TOKENS[:40]
    layer_scores = scores_of(model, surrogate, prompt)
    threshold, budget = pick_threshold(layer_scores, quantile), 30
    config = CacheConfig(
        method="kvzap", budget=budget, recent=RECENT, n_sink=N_SINK, threshold=threshold
    )
    caches = make_caches(model, config, surrogate=surrogate)
    full = [KVCache() for _ in model.layers]
    model(mx.array(prompt)[None], cache=full)
    model(mx.array(prompt)[None], cache=caches)
    below_budget = 0
    for cache, plain, scores in zip(caches, full, layer_scores, strict=True):
        held = [list(range(len(prompt)))] * scores.shape[0]
        expected = threshold_keep(scores, held, len(prompt), threshold, budget)
        got = kept_positions(np.array(cache.keys[0]), np.array(plain.keys[0]))
        assert got == expected
        below_budget += cache.size() < budget
    assert below_budget, "the threshold should bind below the budget somewhere"


def test_without_binding_the_budget_is_the_cap(model, surrogate):
    """A threshold below every score keeps what the budget alone keeps."""
    prompt = TOKENS[:40]
    low = CacheConfig(method="kvzap", budget=20, recent=RECENT, n_sink=N_SINK, threshold=-1e6)
    plain = CacheConfig(method="kvzap", budget=20, recent=RECENT, n_sink=N_SINK)
    kept = []
    for config in (low, plain):
        caches = make_caches(model, config, surrogate=surrogate)
        model(mx.array(prompt)[None], cache=caches)
        kept.append([np.array(c.keys) for c in caches])
    for a, b in zip(*kept, strict=True):
        np.testing.assert_array_equal(a, b)


def test_decode_steps_are_compacted_by_the_threshold(model, surrogate):
    """Decoded rows join; every ``THRESHOLD_EVERY`` steps the rows below the threshold go.
    Checked exactly on the first layer, whose rows and scores no eviction upstream changes
    (deeper layers read what earlier layers kept); every layer stays within its budget."""
    prompt, steps = TOKENS[:16], THRESHOLD_EVERY + 12
    tokens = TOKENS[: len(prompt) + steps]
    scores = scores_of(model, surrogate, tokens)[0]
    threshold, budget = pick_threshold([scores], 0.8), 200
    config = CacheConfig(
        method="kvzap", budget=budget, recent=RECENT, n_sink=N_SINK, threshold=threshold
    )
    caches = make_caches(model, config, surrogate=surrogate)
    full = [KVCache() for _ in model.layers]
    for cache_set in (caches, full):
        model(mx.array(prompt)[None], cache=cache_set)
        for t in tokens[len(prompt) :]:
            model(mx.array([[t]]), cache=cache_set)
    H = scores.shape[0]
    held = threshold_keep(scores, [list(range(len(prompt)))] * H, len(prompt), threshold, budget)
    offset, compacted = len(prompt), False
    for _ in range(steps):
        if offset - len(prompt) + 1 == THRESHOLD_EVERY:  # before the step's own row
            before = len(held[0])
            held = threshold_keep(scores, held, offset, threshold, budget)
            compacted = len(held[0]) < before
        held = [rows + [offset] for rows in held]
        offset += 1
    assert compacted, "the compaction should drop rows on the first layer"
    assert kept_positions(np.array(caches[0].keys[0]), np.array(full[0].keys[0])) == held
    assert all(c.offset == len(tokens) and c.size() <= budget for c in caches)


@pytest.mark.parametrize(
    ("settings", "match"),
    [
        ({"method": "qfilters"}, "method must be kvzap"),
        ({"method": "kvzap", "threshold": float("inf")}, "finite"),
        ({"method": "kvzap", "threshold": True}, "finite"),
        ({"method": "kvzap", "budget_mode": "adaptive"}, "per_head"),
    ],
)
def test_bad_thresholds_are_refused_naming_the_setting(settings, match):
    with pytest.raises(ConfigError, match=match) as err:
        CacheConfig(**{"threshold": -5.0, "budget": 64, "recent": 8, **settings})
    assert err.value.param == "threshold"


def test_keeping_positions_keeps_the_same_rows(model, surrogate):
    """A request asking which rows were kept (``positions``) keeps the same rows, decode
    compactions included (its decode rows take another path to the cache)."""
    prompt, steps = TOKENS[:16], THRESHOLD_EVERY + 12
    scores = scores_of(model, surrogate, TOKENS[: len(prompt) + steps])[0]
    threshold = pick_threshold([scores], 0.8)
    kept = []
    for positions in (False, True):
        config = CacheConfig(
            method="kvzap",
            budget=200,
            recent=RECENT,
            n_sink=N_SINK,
            threshold=threshold,
            positions=positions,
        )
        caches = make_caches(model, config, surrogate=surrogate)
        model(mx.array(prompt)[None], cache=caches)
        for t in TOKENS[len(prompt) : len(prompt) + steps]:
            model(mx.array([[t]]), cache=caches)
        kept.append([np.array(c.kept()[0]) for c in caches])
    for a, b in zip(*kept, strict=True):
        np.testing.assert_array_equal(a, b)
    assert kept[0][0].shape[2] < len(prompt) + steps  # the compaction dropped rows
