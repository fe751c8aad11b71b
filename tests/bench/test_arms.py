"""The studies' shared prompt block against a direct prefill: a kvzap arm fed the block keeps
the rows, and their surrogate scores, that running the model on its caches keeps (the block
carries each layer's input-norm output), on a tiny random model and random surrogates."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from bench.arms import Arm, feed_block, select_arms, standard_arms
from bench.studies.retrieval.retrieval import prefill_block
from qfserve.calibrations.kvzap.surrogate import Surrogate
from tests.tiny import make_tiny_model

PROMPT = [int(t) for t in np.random.default_rng(1).integers(20, 500, size=49)]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=2)


def surrogate_for(model, seed: int = 0) -> Surrogate:
    """A linear surrogate of random weights shaped for ``model``."""
    args, rng = model.args, np.random.default_rng(seed)
    L, D, H = args.num_hidden_layers, args.hidden_size, args.num_key_value_heads
    weights = {"w": rng.normal(size=(L, D, H)) * 0.1, "b": rng.normal(size=(L, H))}
    weights = {k: v.astype(np.float32) for k, v in weights.items()}
    return Surrogate("linear", weights, [True] * L, "tiny", "fp")


def state(caches):
    """Per layer, the rows kept (their keys, in the cache's order) and their scores."""
    return [(np.array(c.keys), np.array(c.scores)) for c in caches]


@pytest.mark.parametrize("recent_frac", [0.0, 0.25])
def test_a_kvzap_arm_fed_the_block_keeps_what_a_direct_prefill_keeps(model, recent_frac):
    arm, budget, surrogate = Arm("kvzap", recent_frac), 16, surrogate_for(model)
    direct = arm.caches(model, budget, None, surrogate=surrogate)
    model(mx.array(PROMPT[:-1])[None], cache=direct)
    fed = arm.caches(model, budget, None, surrogate=surrogate)
    feed_block(fed, prefill_block(model, PROMPT, queries=True, hidden=True))
    for (keys_d, score_d), (keys_f, score_f) in zip(state(direct), state(fed), strict=True):
        np.testing.assert_allclose(keys_f, keys_d, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(score_f, score_d, rtol=1e-4, atol=1e-4)
        assert score_f.min() > -1e3  # every row scored by the surrogate, none by its fallback
    assert all(c.size() == budget and c.offset == len(PROMPT) - 1 for c in fed)


def test_a_block_without_hidden_states_is_refused_for_a_kvzap_arm(model):
    caches = Arm("kvzap", 0.25).caches(model, 16, None, surrogate=surrogate_for(model))
    block = prefill_block(model, PROMPT, hidden=True)
    with pytest.raises(ValueError, match="hidden states"):
        feed_block(caches, [replace(b, hidden=None) for b in block])
    with pytest.raises(ValueError, match="surrogates"):
        Arm("kvzap", 0.25).caches(model, 16, None)


def test_kvzap_adds_its_arms_per_recent_window_of_the_plain_qfilters():
    args = SimpleNamespace(kvzap=True, only=None, query_aware=False, kvzip=False)
    names = [a.name for a in select_arms(standard_arms((0.0, 0.25)), args)]
    assert [n for n in names if n.startswith("kvzap")] == [
        "kvzap/r0",
        "kvzap/r25",
        "kvzap/r0/global",
        "kvzap/r25/global",
    ]
