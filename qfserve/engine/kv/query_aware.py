"""Query-aware comparison methods: SnapKV and TOVA, scored from the queries the model computes.

Q-Filters needs no query at eviction time; these two do, which is why they are reference
arms here rather than defaults. Both read the layer's rotated queries from its
:class:`qfserve.engine.kv.selfcal.QueryTap` (mlx-lm rotates a block's queries before its keys reach
the cache) and score with the layer's own attention (softmax of ``q . k * scale``), averaged
over the query heads of each KV head's GQA group.

* **SnapKV** (Li et al., 2024, arXiv 2404.14469): a prompt block's keys are scored once by
  the attention its last ``window`` queries (the observation window) pay them, averaged
  over the window and smoothed by an average pool over neighbouring positions
  (``kernel``), so the rows around an attended row survive with it. A block is scored on
  its own (a prompt prefilled in chunks is selected chunk by chunk, each chunk's window
  over that chunk's keys). SnapKV selects from the prompt only: a generated row ranks below
  every prompt row, so decoding keeps the selected prompt rows plus the recent window
  (give it ``recent > 0``).
* **TOVA** (Oren et al., 2024, arXiv 2401.06104): every update re-scores every stored row
  by the attention of the newest query, so each decode step evicts the row the current
  token attends to least (a prompt block: the row its last query attends to least).

What they cost: the attention weights are computed a second time per update (SnapKV per
prompt block; TOVA every step, ``O(budget)`` per head like attention itself), and neither
works with chunks or head-adaptive budgets.
"""

from __future__ import annotations

import mlx.core as mx

from qfserve.engine.kv.scorers import AlwaysReady
from qfserve.engine.kv.selfcal import QueryTap

DEFAULT_WINDOW = 32  # SnapKV's observation window
DEFAULT_KERNEL = 5  # SnapKV's pooling kernel


def attention_weights(queries: mx.array, keys: mx.array, scale: float) -> mx.array:
    """Softmax attention of ``queries`` over ``keys``, averaged over each GQA group.

    Args:
        queries: ``(1, H_q, W, D)`` rotated queries, each at or after every key's position
            it may see (``causal_from`` marks the others).
        keys: ``(1, H, S, D)``.
        scale: The layer's attention scale.
    Returns:
        ``(1, H, W, S)`` float32.
    """
    _, Hq, W, D = queries.shape
    H = keys.shape[1]
    q = queries.astype(mx.float32).reshape(1, H, Hq // H, W, D)
    k = keys.astype(mx.float32)[:, :, None]  # (1, H, 1, S, D)
    logits = (q @ k.swapaxes(-1, -2)) * scale  # (1, H, G, W, S)
    return mx.softmax(logits, axis=-1).mean(axis=2)


def _block_queries(tap: QueryTap, n: int, method: str) -> mx.array:
    queries = tap.take(n)
    if queries is None:
        raise RuntimeError(
            f"{method} needs the block's rotated queries from the layer's query tap, and the "
            "tap holds none for this block (were the keys fed without running the model?)"
        )
    return queries


class SnapKVScorer(AlwaysReady):
    """SnapKV's one-shot prompt scores (see the module doc).

    Args:
        tap: The layer's query tap.
        scale: The layer's attention scale.
        window: Observation window: the block's last queries that vote.
        kernel: Width of the average pool over positions (odd).
    """

    def __init__(
        self,
        tap: QueryTap,
        *,
        scale: float,
        window: int = DEFAULT_WINDOW,
        kernel: int = DEFAULT_KERNEL,
    ) -> None:
        if window < 1 or kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"window must be >= 1 and kernel odd, got {window}, {kernel}")
        self.tap = tap
        self.scale = scale
        self.window = window
        self.kernel = kernel

    def score(self, keys: mx.array, start: int) -> mx.array:
        B, H, N, _ = keys.shape
        if N == 1:  # a generated row: below every prompt row (weights are >= 0)
            return mx.full((B, H, 1), -1.0, dtype=mx.float32)
        w = min(self.window, N)
        queries = _block_queries(self.tap, N, "SnapKV")[:, :, N - w :]  # (1, H_q, w, D)
        weights = attention_weights(queries, keys, self.scale)  # (1, H, w, N)
        # Window query j sits at block position N - w + j and sees keys up to there.
        seen = mx.arange(N)[None, :] <= mx.arange(N - w, N)[:, None]  # (w, N)
        votes = mx.where(seen, weights, 0.0).mean(axis=2)  # (1, H, N)
        half = self.kernel // 2
        padded = mx.pad(votes, [(0, 0), (0, 0), (half, half)])
        pooled = padded[..., :N]
        for i in range(1, self.kernel):
            pooled = pooled + padded[..., i : i + N]
        return pooled / self.kernel


class TOVAScorer(AlwaysReady):
    """TOVA's scores: the newest query's attention over every stored row, each update.

    Args:
        tap: The layer's query tap.
        scale: The layer's attention scale.
    """

    dynamic = True  # the cache replaces every row's score through rescore()

    def __init__(self, tap: QueryTap, *, scale: float) -> None:
        self.tap = tap
        self.scale = scale

    def score(self, keys: mx.array, start: int) -> mx.array:
        raise RuntimeError("TOVA scores every stored row at once: the cache calls rescore()")

    def rescore(self, keys: mx.array, n_new: int) -> mx.array:
        """``(1, H, S)`` scores of every row in ``keys`` (stored rows, then the ``n_new``
        just written), by the attention of the newest query."""
        queries = _block_queries(self.tap, n_new, "TOVA")[:, :, -1:]  # (1, H_q, 1, D)
        return attention_weights(queries, keys, self.scale)[:, :, 0]
