"""Eviction on a model whose layers mix sliding windows and global attention (Gemma 3's
layout, a tiny random one): the sliding layers keep mlx-lm's rotating caches, the global ones
evict with every method, and statistics, admission, kvzip's pass and disk reuse count each
kind for what it is."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import RotatingKVCache

from qfserve.engine.kv.cache import EvictionCache, FullKVCache
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.kv.kvzip import RepeatPrompt, compress
from qfserve.engine.kv.layout import layout
from qfserve.engine.kv.memory import kv_need, need_param
from qfserve.engine.kv.stats import summarize
from qfserve.engine.reuse import disk
from tests.gguf_families import FAMILIES, make_family_model

WINDOW = FAMILIES["gemma3"]["sliding_window"]  # 8
PROMPT = [int(t) for t in np.random.default_rng(0).integers(5, 300, 40)]
ROW = 1 * 32 * 2 * 4  # one KV head of 32, keys and values, float32


@pytest.fixture(scope="module")
def model():
    return make_family_model("gemma3", 320, tied=True, seed=0)


def prefill(model, caches, tokens=PROMPT):
    logits = model(mx.array([tokens]), cache=caches)
    mx.eval(logits)
    return logits[0, -1]


def greedy(model, caches, n=12):
    out = [int(mx.argmax(prefill(model, caches)).item())]
    for _ in range(n - 1):
        out.append(int(mx.argmax(prefill(model, caches, [out[-1]])).item()))
    return out


def test_layout_is_five_sliding_layers_to_one_global(model):
    assert layout(model).windows == (WINDOW,) * 5 + (None,)
    assert layout(model).window_rows(100) == 5 * WINDOW and layout(model).window_rows(3) == 15


@pytest.mark.parametrize("method", ["qfilters", "knorm", "streaming", "snapkv", "tova", "kvzip"])
def test_only_global_layers_evict_and_bytes_count_every_layer(model, method):
    # Calibrated filters for Q-Filters (the key-SVD fallback keeps every row while it learns).
    filters = mx.ones((6, 1, 32)) / 32**0.5 if method == "qfilters" else None
    caches = make_caches(model, CacheConfig(method=method, budget=16, recent=4), filters=filters)
    assert [type(c) for c in caches] == [RotatingKVCache] * 5 + [EvictionCache]
    prefill(model, caches)
    if method == "kvzip":
        compress(model, caches, PROMPT, RepeatPrompt(first=[5, 6, 7], next=[8, 9], suffix=[10]))
    stats = summarize(caches)
    assert (stats.evicting_layers, stats.window_layers) == (1, 5)
    assert stats.window_bytes == 5 * WINDOW * ROW
    assert stats.kept_bytes == stats.window_bytes + caches[-1].size() * ROW
    assert stats.full_seq_bytes == stats.window_bytes + len(PROMPT) * ROW
    assert caches[-1].size() <= 17 and stats.tokens_kept <= 17


def test_a_budget_above_the_prompt_decodes_as_the_full_cache(model):
    full = greedy(model, make_caches(model, CacheConfig(method="full")))
    for method in ("qfilters", "kvzip", "streaming"):
        assert greedy(model, make_caches(model, CacheConfig(method=method, budget=256))) == full


def test_admission_counts_the_windows_once_and_the_global_rows_by_the_budget(model):
    loaded = SimpleNamespace(model=model, config={})
    full = kv_need(loaded, CacheConfig(method="full"), 1000, 24)
    assert full == 5 * WINDOW * ROW + 1024 * ROW
    evicting = CacheConfig(budget=64, recent=16)
    per_row = ROW + 8  # its score and slot order
    assert kv_need(loaded, evicting, 1000, 24) == 5 * WINDOW * ROW + 65 * per_row
    assert need_param(evicting) == "budget"


def test_mixed_caches_round_trip_through_disk(model, tmp_path):
    config = CacheConfig(budget=16, recent=4)
    caches = make_caches(model, config)
    prefill(model, caches)
    key = ("m", *dataclasses.astuple(config), "fallback", None)
    path = disk.save(tmp_path, key, PROMPT, caches, "fp")
    _, tokens, restored = disk.load(path, "fp", lambda c: make_caches(model, c))
    assert tokens == PROMPT
    nxt = [7]
    a = prefill(model, caches, nxt)
    b = prefill(model, restored, nxt)
    np.testing.assert_array_equal(np.array(a), np.array(b))
    assert type(restored[0]) is RotatingKVCache and restored[0].offset == len(PROMPT) + 1


def test_full_method_keeps_full_caches_beside_the_windows(model):
    caches = make_caches(model, CacheConfig(method="full"))
    assert [type(c) for c in caches] == [RotatingKVCache] * 5 + [FullKVCache]
