"""Every scorer's batched form (what a packed decode step computes for it) against a numpy
evaluation of that form and against the scorer's own ``score``; the protocol's defaults."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from qfserve.engine.kv.kvzip import KVzipScorer
from qfserve.engine.kv.query_aware import SnapKVScorer, TOVAScorer
from qfserve.engine.kv.scorers import (
    KeySVDScorer,
    KNormScorer,
    QFilterScorer,
    RecencyScorer,
    ScoreForm,
)
from qfserve.engine.kv.selfcal import QueryTap, SelfCalibratingScorer

H, D, N, START = 3, 8, 5, 17
rng = np.random.default_rng(0)
KEYS = rng.standard_normal((1, H, N, D)).astype(np.float32)
FILTERS = rng.standard_normal((H, D)).astype(np.float32)
SCALE = rng.uniform(0.5, 2.0, (H,)).astype(np.float32)


def numpy_form(form: ScoreForm, keys: np.ndarray, start: int) -> np.ndarray:
    if form.kind == "project":
        assert form.direction is not None
        direction = np.broadcast_to(np.array(form.direction), (keys.shape[0], H, D))
        out = np.einsum("bhnd,bhd->bhn", keys, direction)
        return out if form.scale is None else out * np.array(form.scale)[None]
    if form.kind == "norm":
        return -np.sqrt((keys**2).sum(-1))
    return np.broadcast_to(
        np.arange(start, start + keys.shape[2], dtype=np.float32), keys.shape[:3]
    )


def ready_key_svd(sign: int) -> KeySVDScorer:
    s = KeySVDScorer(calib_tokens=4, sign=sign)
    s.observe(mx.array(rng.standard_normal((1, H, 16, D)).astype(np.float32)), 16)
    return s


def frozen_selfcal(sign: int) -> SelfCalibratingScorer:
    s = SelfCalibratingScorer(QueryTap(), budget=8, sign=sign)
    s.filters = mx.array(FILTERS)
    return s


SCORERS = {
    "qfilters": lambda: QFilterScorer(mx.array(FILTERS)),
    "qfilters-sign": lambda: QFilterScorer(mx.array(FILTERS), sign=-1),
    "qfilters-scaled": lambda: QFilterScorer(mx.array(FILTERS), query_scale=mx.array(SCALE)),
    "knorm": KNormScorer,
    "streaming": RecencyScorer,
    "key-svd": lambda: ready_key_svd(1),
    "key-svd-sign": lambda: ready_key_svd(-1),
    "selfcal": lambda: frozen_selfcal(1),
    "selfcal-sign": lambda: frozen_selfcal(-1),
}


@pytest.mark.parametrize("name", SCORERS)
def test_the_batched_form_scores_as_the_scorer_does(name):
    scorer = SCORERS[name]()
    form = scorer.form()
    assert form is not None and not scorer.dynamic
    want = np.array(scorer.score(mx.array(KEYS), START))
    np.testing.assert_allclose(numpy_form(form, KEYS, START), want, rtol=1e-5, atol=1e-5)


def test_scorers_without_a_form_and_the_dynamic_one():
    tap = QueryTap(scale=D**-0.5)
    assert KeySVDScorer(calib_tokens=4).form() is None  # not ready: nothing to batch yet
    assert SelfCalibratingScorer(tap, budget=8).form() is None
    assert SnapKVScorer(tap, scale=D**-0.5).form() is None
    assert KVzipScorer(tap, KNormScorer()).form() is None
    tova = TOVAScorer(tap, scale=D**-0.5)
    assert tova.dynamic and tova.form() is None
    with pytest.raises(NotImplementedError, match="once"):
        KNormScorer().rescore(mx.array(KEYS), 1)


def test_key_svd_forms_carry_each_sequences_direction():
    """Over a batch of two sequences, key-SVD's form holds both frozen directions, and
    scores every sequence's keys as its ``score`` does."""
    s = KeySVDScorer(calib_tokens=4)
    s.observe(mx.array(rng.standard_normal((2, H, 16, D)).astype(np.float32)), 16)
    form = s.form()
    assert form is not None and form.direction is not None and form.direction.shape == (2, H, D)
    keys = rng.standard_normal((2, H, N, D)).astype(np.float32)
    want = np.array(s.score(mx.array(keys), START))
    np.testing.assert_allclose(numpy_form(form, keys, START), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(form.projected(mx.array(keys))), want, rtol=1e-6)
