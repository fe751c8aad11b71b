"""An independent oracle for the tests: numpy stable argsort, no scan, no threshold."""

from __future__ import annotations

import numpy as np


def argsort_keep(scores: np.ndarray, budget: int, n_sink: int, recent: int) -> np.ndarray:
    """Rows to keep per group: top-``budget`` by ranked score, ties to the lower row.

    Args:
        scores: ``(G, L)`` float32.
    Returns:
        ``(G, budget)`` row indices, ascending.
    """
    L = scores.shape[-1]
    rows = np.arange(L)
    ranked = np.where(np.isnan(scores), -np.inf, scores.astype(np.float64))
    ranked = np.where((rows < n_sink) | (rows >= L - recent), np.inf, ranked)
    # A stable sort of the negated ranks keeps equal ranks in row order: lower row first.
    order = np.argsort(-ranked, axis=-1, kind="stable")[..., :budget]
    return np.sort(order, axis=-1)


def make_scores(rng: np.random.Generator, shape: tuple[int, ...], kind: str) -> np.ndarray:
    """Adversarial score patterns, float32."""
    if kind == "random":
        return rng.standard_normal(shape).astype(np.float32)
    if kind == "ties":  # a handful of distinct values: ties straddle every threshold
        return rng.integers(0, 3, shape).astype(np.float32)
    if kind == "constant":
        return np.full(shape, 0.5, dtype=np.float32)
    if kind == "infinite":
        return rng.choice(np.array([-np.inf, 0.0, np.inf], dtype=np.float32), shape)
    if kind == "nan":
        s = rng.integers(0, 3, shape).astype(np.float32)
        s[rng.random(shape) < 0.2] = np.nan
        return s
    raise ValueError(f"unknown kind {kind!r}")


KINDS = ("random", "ties", "constant", "infinite", "nan")
