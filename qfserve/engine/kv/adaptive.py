"""Head-adaptive budgets (AdaKV, arXiv 2407.11550): one layer's rows shared by its heads.

Per-head eviction keeps ``budget`` rows in every KV head. Adaptive selection keeps
``budget * H`` rows per layer and lets heads whose attention is concentrated give rows to
heads that need them: every head first keeps its ``floor`` best rows (its protected rows
among them), then one top-k over the rest of the layer fills the remaining
``(budget - floor) * H``.

What the shared top-k compares is each row's expected share of its head's attention. The
scores are expected attention logits (:class:`qfserve.engine.kv.scorers.QFilterScorer` with the
calibration's query scales, ``E<q, f> (f . k) / sqrt(d)``), and softmax normalises each head
on its own, so a logit means nothing across heads until its head's log-sum-exp (over the rows
being selected, protected ones included) is subtracted: what is compared is the expected log
attention weight, AdaKV's own criterion (it ranks observed attention weights), estimated
without queries. Within a head the order is unchanged. Comparing the raw logits instead lost
the pass key on SmolLM2-135M at every compression from 2x (a head whose logits run high took
most of the layer's rows whether or not its attention was concentrated).

The result is ragged: head ``h`` keeps ``counts[h]`` rows. It is stored padded to the
largest count, with a ``valid`` mask that attention applies (:mod:`qfserve.engine.kv.attention`).

Ties, as everywhere in the eviction core, go to the lower position; across heads in the
shared top-k, to the lower head.
"""

from __future__ import annotations

import mlx.core as mx

_INF = float("inf")
_LOWEST = float(mx.finfo(mx.float32).min)  # below every eligible score, above ineligible


def exactly_k(ranked: mx.array, k: mx.array | int) -> mx.array:
    """``(G, L)`` bool: the ``k`` largest of each group, ties to the lower index.

    Args:
        ranked: ``(G, L)`` float32 without NaN (``-inf`` allowed).
        k: Rows to keep per group (an int, or ``(G, 1)`` int32), ``0 <= k <= L``.
    """
    G, L = ranked.shape
    kk = mx.full((G, 1), k, dtype=mx.int32) if isinstance(k, int) else k
    ascending = mx.sort(ranked, axis=-1)
    kth = mx.take_along_axis(ascending, mx.clip(L - kk, 0, L - 1), axis=-1)  # (G, 1)
    above = ranked > kth
    tied = ranked == kth
    quota = kk - above.sum(axis=-1, keepdims=True)
    keep = above | (tied & (mx.cumsum(tied.astype(mx.int32), axis=-1) <= quota))
    return keep & (kk > 0)


def select_adaptive(
    scores: mx.array,
    *,
    budget: int,
    n_sink: int,
    recent: int,
    floor: int,
    eligible: mx.array | None = None,
    logits: bool = True,
    cap: int | None = None,
) -> tuple[mx.array, mx.array]:
    """Which rows each head keeps when the layer shares ``budget * H`` rows.

    Args:
        scores: ``(B, H, L)`` float32 expected attention logits; NaN ranks lowest.
        budget: Mean rows per head; the layer keeps ``budget * H``.
        n_sink, recent: Protected rows of every head (the first and the last of ``L``).
        floor: Rows every head keeps at least, ``n_sink + recent <= floor <= budget``.
        eligible: ``(B, H, L)`` bool, False on padding rows that must never be kept.
        logits: The scores are expected logits, normalised per head before the shared
            top-k; ``False``: they are observed attention weights already comparable
            across heads (KVzip's), ranked as they are.
        cap: No head keeps more than its ``cap`` best rows (``floor <= cap``): the layer's
            storage is padded to its longest head, so a cap bounds its bytes.
    Returns:
        ``keep`` ``(B, H, L)`` bool and ``counts`` ``(B, H)`` int32 (``counts.sum(-1)`` is
        ``budget * H`` for every batch row, less where ``eligible`` or ``cap`` leave fewer).
    Raises:
        ValueError: ``floor`` outside ``[n_sink + recent, budget]``.
    """
    if not n_sink + recent <= floor <= budget:
        raise ValueError(
            f"floor must be in [n_sink + recent = {n_sink + recent}, budget = {budget}], "
            f"got {floor}"
        )
    B, H, L = scores.shape
    ok = mx.ones(scores.shape, dtype=mx.bool_) if eligible is None else eligible
    # Expected log attention weights: each head's logits less their log-sum-exp (a head with
    # no eligible row keeps its scores; it has nothing to rank).
    real = ok & ~mx.isnan(scores)
    weights = scores
    if logits:
        lse = mx.logsumexp(mx.where(real, scores, -_INF), axis=-1, keepdims=True)
        weights = scores - mx.where(mx.isfinite(lse), lse, 0.0)
    finite = mx.where(mx.isnan(weights) | (weights == -_INF), _LOWEST, weights)
    ranked = mx.where(ok, finite, -_INF)
    # Sinks and recent rows are each head's first and last *real* rows: a padded head's
    # padding sits between its rows and the block, so slot indices would miss them.
    real = ok.astype(mx.int32)
    from_start = mx.cumsum(real, axis=-1)
    from_end = mx.cumsum(real, axis=-1, reverse=True)
    protected = ok & ((from_start <= n_sink) | (from_end <= recent))
    guarded = mx.where(protected, _INF, ranked)
    if cap is not None and cap < L:
        top = exactly_k(guarded.reshape(B * H, L), cap).reshape(B, H, L)
        ranked, guarded = mx.where(top, ranked, -_INF), mx.where(top, guarded, -_INF)
    own = exactly_k(guarded.reshape(B * H, L), floor).reshape(B, H, L)
    # The shared top-k over what the floors left, flattened head-major: ties to lower heads.
    rest = mx.where(own, -_INF, ranked).reshape(B, H * L)
    shared = exactly_k(rest, (budget - floor) * H).reshape(B, H, L)
    keep = (own | shared) & (guarded > -_INF)  # never padding, nor a row past the cap
    return keep, keep.sum(axis=-1).astype(mx.int32)


def ragged_gather(keep: mx.array, counts: mx.array) -> tuple[mx.array, mx.array]:
    """Kept row indices per head, in temporal order, padded to the largest count.

    Args:
        keep: ``(B, H, L)`` bool.
        counts: ``(B, H)`` int32, ``keep.sum(-1)``.
    Returns:
        ``idx`` ``(B, H, S)`` uint32 (``S = counts.max()``; padding repeats row 0) and
        ``valid`` ``(B, H, S)`` bool.
    """
    L = keep.shape[-1]
    S = int(counts.max().item())  # type: ignore[arg-type]  # an int32 scalar
    rows = mx.arange(L, dtype=mx.uint32)
    idx = mx.sort(mx.where(keep, rows, rows + L), axis=-1)[..., :S]
    valid = mx.arange(S)[None, None, :] < counts[..., None]
    return mx.where(valid, idx, 0).astype(mx.uint32), valid


def slot_order(valid: mx.array, offset: int) -> mx.array:
    """Rank in time of every slot when a decode row joins ragged rows (the slot layout).

    ``valid`` ``(B, H, S + 1)`` marks each head's kept rows (slots ``0 .. count - 1``, in
    temporal order), padding, and the new row in the last slot. The new row gets position
    ``offset - 1``; each head's kept rows the positions just before it, so its latest rows
    (the recent window) carry their true positions; padding gets -1.

    Returns:
        ``(B, H, S + 1)`` int32.
    """
    S = valid.shape[-1] - 1
    counts = valid[..., :S].sum(axis=-1, keepdims=True).astype(mx.int32)  # (B, H, 1)
    slots = mx.arange(S + 1, dtype=mx.int32)
    order = (offset - 1) - counts + slots
    return mx.where(slots == S, offset - 1, mx.where(valid, order, -1)).astype(mx.int32)
