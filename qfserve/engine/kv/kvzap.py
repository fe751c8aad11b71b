"""KVzap's scorer on the eviction core: every row scored as it is written, from a surrogate.

A layer's :class:`KVzapScorer` reads the hidden state its layer's input norm just computed
(:class:`qfserve.calibrations.kvzap.hidden.HiddenTap`) for the rows being written and scores
each by its surrogate (:mod:`qfserve.calibrations.kvzap.surrogate`): the predicted log
KVzip+ score of that row, per KV head. So prompt chunks, later turns and decode steps are all
ranked by one learned estimate of what a reconstruction of the context would read, at the
cost of one small product per row and no extra pass: a prompt under memory pressure is
compressed as it is read, and decode keeps its O(budget) single-row eviction.

Rows it cannot score (a cache restored without its hidden states, which never happens in a
forward pass) rank by K-norm mapped below every surrogate score.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from qfserve.calibrations.kvzap.hidden import HiddenTap
from qfserve.calibrations.kvzap.surrogate import forward
from qfserve.engine.kv.scorers import AlwaysReady

_BELOW = -1e4  # under any log KVzip+ score a surrogate predicts (scores are attention shares)


class KVzapScorer(AlwaysReady):
    """A layer's scorer under ``method="kvzap"``.

    Args:
        tap: The layer's hidden-state tap.
        weights: The layer's surrogate weights (:func:`qfserve.calibrations.kvzap.surrogate.
            forward`'s).
    """

    source = "kvzap"

    def __init__(self, tap: HiddenTap, weights: tuple[mx.array, ...]) -> None:
        self.tap = tap
        self.weights = weights

    @property
    def nbytes(self) -> int:
        return 0  # the weights are the model's, shared by every request

    def score(self, keys: mx.array, start: int) -> mx.array:
        n = keys.shape[2]
        hidden = self.tap.take(n)
        if hidden is None:  # no hidden state for these rows: below every surrogate score
            norms = mx.sqrt(mx.square(keys.astype(mx.float32)).sum(axis=-1))
            return _BELOW - norms
        if hidden.dtype != mx.float32:
            hidden = hidden.astype(mx.float32)
        return forward(hidden, self.weights).transpose(0, 2, 1)  # (1, N, H) -> (1, H, N)


def kvzap_scorer(tap: Any, weights: tuple[mx.array, ...]) -> KVzapScorer:
    """The scorer of one layer (``tap``: its :class:`HiddenTap`)."""
    if not isinstance(tap, HiddenTap):
        raise ValueError("method 'kvzap' needs the layer's hidden-state tap")
    return KVzapScorer(tap, weights)
