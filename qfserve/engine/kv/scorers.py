"""Scorers: how important each stored key is (higher = keep). Nothing else.

When to evict, what is protected and how rows are gathered live in :mod:`qfserve.engine.kv.evict` and
:mod:`qfserve.engine.kv.cache`; a scorer only maps a block of keys to one float32 score per row. Scores
are computed once, when a key is inserted, except by a ``dynamic`` scorer (TOVA), which
re-scores every stored row after each insertion through ``rescore``. A NaN score (from a NaN key) ranks lowest; :mod:`qfserve.engine.kv.evict` handles it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

import mlx.core as mx


@dataclass(frozen=True)
class ScoreForm:
    """A scorer's per-row score as one of the few operations an eviction step computes itself
    (:func:`qfserve.engine.kv.evict.write_and_select`) or a packed decode step batches over
    many requests (:mod:`qfserve.engine.kv.batch.packed`), giving each row the score its own
    :meth:`Scorer.score` would: ``project`` (``keys . direction``, times ``scale`` where
    given), ``norm`` (minus the key's L2 norm), ``position`` (its absolute position), or
    ``hidden`` (a decode row's: ``scale + rms_norm(x) . direction``, a linear map of the
    hidden state ``x`` that entered the layer, before its input norm: KVzap's linear
    surrogate; not batched).
    """

    kind: Literal["project", "norm", "position", "hidden"]
    direction: mx.array | None = None  # (H, D) or (B, H, D) float32, the sign applied
    scale: mx.array | None = None  # (H, 1) float32; ``hidden``: the bias
    hidden: tuple[mx.array, mx.array, float] | None = None  # ``hidden``: x (B, 1, K), norm, eps

    def projected(self, keys: mx.array) -> mx.array:
        """A ``project`` form's scores of ``keys`` ``(B, H, N, D)``: ``(B, H, N)`` float32."""
        if self.kind != "project" or self.direction is None:
            raise ValueError(f"a {self.kind!r} form projects nothing")
        scores = project(keys, self.direction, 1)
        return scores if self.scale is None else scores * self.scale

    def mapped(self) -> mx.array:
        """A ``hidden`` form's score of its row: ``(B, H, 1)`` float32."""
        if self.kind != "hidden" or self.hidden is None or self.direction is None:
            raise ValueError(f"a {self.kind!r} form maps no hidden row")
        x, norm, eps = self.hidden
        out = mx.fast.rms_norm(x, norm, eps) @ self.direction.T  # (B, 1, H)
        return (out if self.scale is None else out + self.scale[:, 0]).transpose(0, 2, 1)


class Scorer(Protocol):
    """The scorer role.

    ``score(keys, start)`` maps ``keys`` ``(B, H, N, D)`` holding positions
    ``start .. start + N - 1`` to ``(B, H, N)`` float32 scores. A scorer that is not
    ``ready`` (the key-SVD fallback before it has seen enough keys) blocks eviction and is
    shown every stored key through ``observe`` until it is. A ``dynamic`` scorer (TOVA)
    re-scores every stored row after each insertion through ``rescore``; every other one
    scores a row once. ``form`` is the batched form of ``score``, or ``None`` where a packed
    decode step cannot batch it. :class:`ScorerBase` gives the defaults.
    """

    source: str  # "calibrated" | "fallback" | "none": reported in cache statistics
    dynamic: bool

    @property
    def ready(self) -> bool: ...

    @property
    def nbytes(self) -> int: ...

    def observe(self, keys: mx.array, tokens_seen: int) -> None: ...

    def score(self, keys: mx.array, start: int) -> mx.array: ...

    def rescore(self, keys: mx.array, n_new: int) -> mx.array: ...

    def form(self) -> ScoreForm | None: ...


class ScorerBase:
    """The protocol's defaults: scores fixed at insertion, no batched form."""

    dynamic = False

    def rescore(self, keys: mx.array, n_new: int) -> mx.array:
        raise NotImplementedError(f"{type(self).__name__} scores a row once, when it is stored")

    def form(self) -> ScoreForm | None:
        return None


def _as_float32(x: mx.array) -> mx.array:
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


def project(keys: mx.array, direction: mx.array, sign: int) -> mx.array:
    """``sign * (keys . direction)`` in float32.

    Args:
        keys: ``(B, H, N, D)`` any float dtype.
        direction: ``(H, D)`` or ``(B, H, D)`` float32.
    Returns:
        ``(B, H, N)`` float32.
    """
    d = direction if sign == 1 else -direction
    return (_as_float32(keys) @ d[..., None]).squeeze(-1)  # (B, H, N)


class AlwaysReady(ScorerBase):
    """A scorer with nothing to learn: ready from the first key, nothing observed."""

    source = "none"
    ready = True

    @property
    def nbytes(self) -> int:
        return 0

    def observe(self, keys: mx.array, tokens_seen: int) -> None:
        return None


class QFilterScorer(AlwaysReady):
    """Calibrated Q-Filters: projection on a per-KV-head filter computed offline from queries.

    Args:
        filters: ``(H, D)`` unit filters for this layer's KV heads.
        sign: ``+1`` (the paper's direction) or ``-1`` (ablation).
        query_scale: ``(H,)`` each head's ``E<q, f>`` from calibration; given, scores are
            expected attention logits ``E<q, f> * (f . k) / sqrt(D)``, comparable across
            heads (what head-adaptive budgets rank by).
    """

    source = "calibrated"

    def __init__(self, filters: mx.array, sign: int = 1, query_scale: mx.array | None = None):
        self.filters = filters.astype(mx.float32)
        self.sign = sign
        self.scale = None
        if query_scale is not None:
            D = self.filters.shape[-1]
            self.scale = (query_scale.astype(mx.float32) / D**0.5)[:, None]  # (H, 1)
        # Signed once: a decode step scores one row a layer, where every op counts.
        signed = self.filters if sign == 1 else -self.filters
        self._form = ScoreForm("project", signed, self.scale)

    @property
    def nbytes(self) -> int:
        return self.filters.nbytes

    def score(self, keys: mx.array, start: int) -> mx.array:
        return self._form.projected(keys)

    def form(self) -> ScoreForm:
        return self._form


class KeySVDScorer(ScorerBase):
    """Key-SVD fallback: estimate each head's direction from the keys it has seen, then freeze.

    Until ``calib_tokens`` keys have been observed there is no direction and nothing is
    evicted. The direction is the top right singular vector of the raw (uncentred) keys of
    each (sequence, KV head), i.e. the top eigenvector of ``K^T K``. What it cannot know:

    * the sign. A query decides which end of the key axis earns attention and the cache has
      none. We orient the axis *against* the observed keys' mean: in the models measured the
      queries' mean points away from the keys' (on SmolLM2-135M the key-SVD axis oriented to
      the keys' mean has a negative cosine with the calibrated filter in 94% of heads; on
      qfserve-tiny the mean-oriented scores correlate with attention at Spearman -0.37), so
      keys low on the shared key axis earn the most attention, which is also why K-norm
      works. ``sign = -1`` keeps the other end (the ablation).
    * a direction independent of traffic. It is frozen from whichever update first crosses
      ``calib_tokens``, so a prompt prefilled in one block and the same prompt fed in chunks
      can freeze different directions and keep different rows (path dependence).

    Calibrated filters (:class:`QFilterScorer`) have neither problem.
    """

    source = "fallback"

    def __init__(self, calib_tokens: int, sign: int = 1):
        self.calib_tokens = calib_tokens
        self.sign = sign
        self.direction: mx.array | None = None  # (B, H, D) once frozen

    @property
    def ready(self) -> bool:
        return self.direction is not None

    @property
    def nbytes(self) -> int:
        return 0 if self.direction is None else self.direction.nbytes

    def observe(self, keys: mx.array, tokens_seen: int) -> None:
        if self.direction is None and tokens_seen >= self.calib_tokens:
            self.direction = estimate_direction(keys)

    def score(self, keys: mx.array, start: int) -> mx.array:
        if self.direction is None:
            raise RuntimeError("KeySVDScorer.score called before the direction was frozen")
        return project(keys, self.direction, self.sign)

    def form(self) -> ScoreForm | None:
        if self.direction is None:
            return None
        return ScoreForm("project", self.direction if self.sign == 1 else -self.direction)


def estimate_direction(keys: mx.array) -> mx.array:
    """Top right singular vector of each head's uncentred keys, oriented against their mean
    (the observed keys project negatively on it; see :class:`KeySVDScorer`).

    Args:
        keys: ``(B, H, T, D)``.
    Returns:
        ``(B, H, D)`` float32 unit vectors.
    """
    k = _as_float32(keys)
    gram = k.swapaxes(-1, -2) @ k  # (B, H, D, D)
    # eigh runs on the CPU stream on every backend; eigenvalues ascend, so the last is top.
    _, vecs = mx.linalg.eigh(gram, stream=mx.cpu)
    top = vecs[..., -1]  # (B, H, D)
    mean_proj = (k @ top[..., None]).sum(axis=(-2, -1))  # (B, H)
    orient = mx.where(mean_proj > 0, -1.0, 1.0)[..., None]
    return top * orient


class KNormScorer(AlwaysReady):
    """K-norm: keys with a small L2 norm tend to receive more attention, so score = -||k||."""

    def score(self, keys: mx.array, start: int) -> mx.array:
        return -mx.sqrt(mx.square(_as_float32(keys)).sum(axis=-1))

    def form(self) -> ScoreForm:
        return ScoreForm("norm")


class RecencyScorer(AlwaysReady):
    """StreamingLLM: score = position, so the kept rows are the sinks plus the latest ones."""

    def score(self, keys: mx.array, start: int) -> mx.array:
        B, H, N, _ = keys.shape
        positions = mx.arange(start, start + N, dtype=mx.float32)
        return mx.broadcast_to(positions, (B, H, N))

    def form(self) -> ScoreForm:
        return ScoreForm("position")
