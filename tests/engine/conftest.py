"""Fixtures shared by the engine tests."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from qfserve.engine.models.loading import default_model_path, load_model


class _Drifted(nn.Module):
    """``q_proj`` plus a constant: every head's query drifts along one RoPE dimension."""

    def __init__(self, inner: nn.Module, drift: mx.array):
        super().__init__()
        self.inner = inner
        self._drift = drift

    def __call__(self, x: mx.array) -> mx.array:
        return self.inner(x) + self._drift


@pytest.fixture(scope="module")
def drifted():
    """The tiny model with a planted query drift: a constant added to every head's query
    along its slowest-rotating RoPE dimension. Returns ``(model, tokens of a prompt)``."""
    loaded = load_model(str(default_model_path()))
    model = loaded.model
    rng = np.random.default_rng(0)
    for layer in model.layers:
        attn = layer.self_attn
        D = attn.q_proj.weight.shape[0] // attn.n_heads
        drift = np.zeros((attn.n_heads, D), dtype=np.float32)
        # Dimension D/2 - 1 pairs with D - 1 at RoPE's lowest frequency: it barely turns.
        drift[:, D // 2 - 1] = rng.choice([-1.0, 1.0], attn.n_heads) * 6.0
        attn.q_proj = _Drifted(attn.q_proj, mx.array(drift.reshape(-1)))
    tokens = loaded.tokenizer.encode(" ".join(f"word{i % 37} is {i}" for i in range(120)))
    return model, tokens
