"""The module that fills caches without the output head, against the whole model: the same
keys and values in every layer, the same next-token logits after; and the models it must
run whole."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from qfserve.calibrations.model_info import body, fill
from tests.tiny import make_tiny_model


def test_filled_caches_equal_the_whole_models():
    model = make_tiny_model()
    assert body(model) is model.model
    tokens = mx.array(np.random.default_rng(0).integers(0, 512, (1, 40)).astype(np.int32))
    whole, ours = make_prompt_cache(model), make_prompt_cache(model)
    for s in range(0, 40, 16):  # chunks, as the server reads a prompt
        model(tokens[:, s : s + 16], cache=whole)
        fill(model, tokens[:, s : s + 16], ours)
    for a, b in zip(whole, ours, strict=True):
        assert a.offset == b.offset == 40
        np.testing.assert_array_equal(np.array(a.state[0]), np.array(b.state[0]))
        np.testing.assert_array_equal(np.array(a.state[1]), np.array(b.state[1]))
    nxt = mx.array([[7]])
    np.testing.assert_array_equal(
        np.array(model(nxt, cache=whole)), np.array(model(nxt, cache=ours))
    )


class _NoInner(nn.Module):
    """A model without ``model.model``: it runs whole."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = [nn.Linear(2, 2)]
        self.calls = 0

    def __call__(self, x, cache=None):  # type: ignore[no-untyped-def]
        self.calls += 1
        return x


class _Inner(nn.Module):
    def __init__(self, layers: list) -> None:
        super().__init__()
        self.layers = layers

    def __call__(self, x):  # type: ignore[no-untyped-def]  # takes no cache
        return x


def test_models_built_otherwise_run_whole():
    plain = _NoInner()
    assert body(plain) is plain
    fill(plain, mx.zeros((1, 2)), None)
    assert plain.calls == 1
    wrapped = _NoInner()
    wrapped.model = _Inner(wrapped.layers)  # holds the layers but takes no cache
    assert body(wrapped) is wrapped
    other = _NoInner()
    other.model = _Inner([nn.Linear(2, 2)])  # not the layers the model names
    assert body(other) is other
