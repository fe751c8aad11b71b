"""Self-calibrated Q-Filters against the offline calibration of the same queries.

The reference is ``calibrations``' own pipeline: ``capture_queries`` samples the post-RoPE
queries of the same prompt (every one of them: the sample is larger than the prompt) and
``compute_filters`` runs the numpy SVD, sign anchoring and GQA averaging. The model is the
tiny one with a planted query drift (``drifted`` in ``conftest.py``), so each head has one
clear top direction whose sign calibration must recover.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from qfserve.calibrations.capture import capture_queries
from qfserve.calibrations.compute import compute_filters
from qfserve.engine.kv.cache import EvictionCache
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.kv.selfcal import SelfCalibratingScorer
from qfserve.engine.models.loading import default_model_path, load_model

BUDGET = 96


def offline(model, tokens):
    samples = capture_queries(model, [tokens], samples_per_head=len(tokens) + 1)
    n_kv = model.layers[0].self_attn.n_kv_heads
    return compute_filters([s.queries for s in samples], n_kv)[0]  # (layers, KV, D)


def self_filters(caches):
    out = []
    for c in caches:
        assert isinstance(c, EvictionCache) and isinstance(c.scorer, SelfCalibratingScorer)
        assert c.scorer.ready and c.scorer.source == "self"
        out.append(np.array(c.scorer.filters))
    return np.stack(out)


def cosines(a, b):
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.mark.parametrize("chunk", [None, 64])
def test_a_prompts_own_filter_is_the_offline_filter_of_its_queries(drifted, chunk):
    model, tokens = drifted
    config = CacheConfig(method="qfilters", budget=BUDGET, recent=8)
    caches = make_caches(model, config, self_calibrate=True)
    step = chunk or len(tokens)
    for start in range(0, len(tokens), step):
        model(mx.array(tokens[start : start + step])[None], cache=caches)
        mx.eval([c.state for c in caches])
    # Frozen at the first block that overflowed the budget, from every query until then.
    seen = len(tokens) if chunk is None else -(-(BUDGET + 1) // chunk) * chunk
    assert all(c.scorer.queries_seen == seen for c in caches)
    got, want = self_filters(caches), offline(model, tokens[:seen])
    cos = cosines(got, want)
    assert cos.min() > 0.99, cos  # the same direction, and the same sign
    # And it was in place for the first eviction: the kept rows of the first overflowing
    # block are its top-k (numpy) by projection on that filter, sinks and recent kept.
    if chunk is None:
        cache = caches[0]
        keys, _, _ = cache.kept()
        assert cache.evictions == 1 and keys.shape[2] == BUDGET


def test_the_first_eviction_keeps_the_top_rows_of_the_self_filter(drifted):
    model, tokens = drifted
    n_sink, recent = 4, 8
    config = CacheConfig(method="qfilters", budget=BUDGET, recent=recent, n_sink=n_sink)
    caches = make_caches(model, config, self_calibrate=True)
    # The full cache's keys of layer 0 (same forward pass: the layer's keys do not depend on
    # its cache), to rank by the filter in numpy.
    plain = make_caches(model, CacheConfig(method="full"))
    x = mx.array(tokens)[None]
    model(x, cache=caches)
    model(x, cache=plain)
    keys = np.array(plain[0].keys[..., : len(tokens), :])[0]  # (KV, L, D)
    f = np.array(caches[0].scorer.filters)  # (KV, D)
    scores = np.einsum("hld,hd->hl", keys, f)
    L = len(tokens)
    scores[:, :n_sink] = np.inf
    scores[:, L - recent :] = np.inf
    for h in range(keys.shape[0]):
        want = np.sort(np.argsort(-scores[h], kind="stable")[:BUDGET])
        kept, _, _ = caches[0].kept()
        got_rows = np.array(kept[0, h])
        np.testing.assert_allclose(got_rows, keys[h, want], atol=1e-5)


def test_decoding_adds_no_eval_even_when_the_filter_freezes_there(drifted, monkeypatch):
    model, tokens = drifted
    short = tokens[:40]  # shorter than the budget: the first eviction is a decode step
    config = CacheConfig(method="qfilters", budget=len(short) + 3, recent=2)
    caches = make_caches(model, config, self_calibrate=True)
    model(mx.array(short)[None], cache=caches)
    mx.eval([c.state for c in caches])
    assert not any(c.scorer.ready for c in caches)
    calls = []
    for name in ("eval", "async_eval"):
        real = getattr(mx, name)
        monkeypatch.setattr(mx, name, lambda *a, _real=real, _n=name: calls.append(_n) or _real(*a))
    token = mx.array([[short[-1]]])
    graphs = []
    for _ in range(6):
        graphs.append(model(token, cache=caches))  # graph building only: nothing evaluated
    assert calls == []
    monkeypatch.undo()
    mx.eval(graphs, [c.state for c in caches])
    assert all(c.scorer.ready and c.evictions > 0 for c in caches)
    got, want = self_filters(caches), offline(model, short)
    assert cosines(got, want).min() > 0.99


def test_a_one_token_prompt_falls_back_to_the_keys(drifted):
    model, tokens = drifted
    caches = make_caches(
        model, CacheConfig(method="qfilters", budget=8, recent=0), self_calibrate=True
    )
    for t in tokens[:12]:
        model(mx.array([[t]]), cache=caches)
    mx.eval([c.state for c in caches])
    assert all(c.scorer.ready and c.scorer.source == "fallback" for c in caches)
    assert all(c.size() == 8 for c in caches)


@pytest.mark.parametrize(
    "mode, expected", [("prompt", "self"), ("traffic", "fallback"), ("off", "fallback")]
)
def test_the_server_self_calibrates_a_model_without_an_artifact(mode, expected):
    import dataclasses

    from qfserve.engine.text.requests import Finished, GenerationRequest, SamplingParams
    from tests.workers import complete, serving, worker_for

    loaded = load_model(str(default_model_path()))
    loaded = dataclasses.replace(loaded, model_id="test/never-calibrated")
    with serving(worker_for(loaded, self_calibration=mode)) as worker:
        assert worker.filter_source == expected
        assert worker.calibration.learning == (mode != "off")  # pooling traffic's queries
        prompt = tuple(loaded.tokenizer.encode(" ".join(f"w{i} is {i}" for i in range(60))))
        req = GenerationRequest(
            kind="completion",
            prompt=prompt,
            sampling=SamplingParams(max_tokens=4, temperature=0.0),
            cache=CacheConfig(method="qfilters", budget=64, recent=8),
        )
        final = complete(worker, req)
    assert isinstance(final, Finished), final
    assert final.kv_cache["filter_source"] == expected
    assert final.kv_cache["evictions"] > 0 and final.kv_cache["tokens_kept"] <= 64


def test_a_saved_self_calibrated_cache_restores_its_filter(drifted, tmp_path):
    from qfserve.engine.reuse import disk as persist
    from qfserve.engine.reuse.kept import cache_key

    model, tokens = drifted
    config = CacheConfig(method="qfilters", budget=BUDGET, recent=8)
    caches = make_caches(model, config, self_calibrate=True)
    model(mx.array(tokens)[None], cache=caches)
    mx.eval([c.state for c in caches])
    key = cache_key("tiny", config, "self")
    path = persist.save(tmp_path, key, list(tokens), caches, "fp")
    _, _, restored = persist.load(
        path, "fp", lambda cfg: make_caches(model, cfg, self_calibrate=True)
    )
    np.testing.assert_array_equal(self_filters(restored), self_filters(caches))
    token = mx.array([[tokens[-1]]])
    np.testing.assert_array_equal(  # the next step evicts the same row either way
        np.array(model(token, cache=restored)), np.array(model(token, cache=caches))
    )
    assert [c.free.tolist() for c in restored] == [c.free.tolist() for c in caches]
