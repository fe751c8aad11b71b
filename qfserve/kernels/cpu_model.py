"""An executable CPU model of the apply kernel, in numpy, mirroring it step by step.

CI has no GPU, so this is how the kernel's *algorithm* is tested there: threadgroups, each
thread owning a contiguous run of rows, the per-thread counts of strictly-above and tied rows,
the Hillis-Steele scan over them (with its barriers), the two admission tiers, the slot each
survivor is written to, and the copy. Every step below names the phase of
:data:`qfserve.kernels.sources.APPLY` it models. No MLX import:
``bench/studies/kernel_cuda.py`` uses it too.
"""

from __future__ import annotations

import numpy as np

from qfserve.kernels.sources import DEFAULT_THREADS

_INF = np.float32(np.inf)


def rank(s: np.float32, i: int, L: int, n_sink: int, recent: int) -> np.float32:
    """``qf_rank``: NaN ranks last (-inf), protected rows first (+inf)."""
    s = -_INF if s != s else s
    return _INF if (i < n_sink or i + recent >= L) else s


def threshold(scores: np.ndarray, *, budget: int, n_sink: int, recent: int) -> np.ndarray:
    """The host side: the ``budget``-th largest ranked score of each group.

    Args:
        scores: ``(G, L)`` float32.
    Returns:
        ``(G,)`` float32.
    """
    G, L = scores.shape
    rows = np.arange(L)
    ranked = np.where(np.isnan(scores), -_INF, scores)
    ranked = np.where((rows < n_sink) | (rows + recent >= L), _INF, ranked).astype(np.float32)
    kth = L - budget
    return np.partition(ranked, kth, axis=-1)[:, kth]


def threadgroup_keep_rows(
    scores: np.ndarray,
    th: np.float32,
    *,
    budget: int,
    n_sink: int,
    recent: int,
    threads: int = DEFAULT_THREADS,
) -> np.ndarray:
    """Phases 1-3 of one threadgroup: the ``keep_rows`` staging buffer it fills.

    Args:
        scores: ``(L,)`` float32, one group's stored scores.
        th: the group's threshold.
    Returns:
        ``(budget,)`` int64 row indices in slot order.
    Raises:
        RuntimeError: a slot is written twice or left empty (the kernel's invariant broke).
    """
    L = scores.shape[0]
    chunk = (L + threads - 1) // threads
    runs = [(min(t * chunk, L), min(min(t * chunk, L) + chunk, L)) for t in range(threads)]

    # Phase 1: every thread counts its own run.
    n_above = np.zeros(threads, dtype=np.uint32)
    n_tied = np.zeros(threads, dtype=np.uint32)
    for t, (lo, hi) in enumerate(runs):
        for i in range(lo, hi):
            r = rank(scores[i], i, L, n_sink, recent)
            n_above[t] += r > th
            n_tied[t] += r == th

    # Phase 2: inclusive Hillis-Steele scan. All threads read, barrier, all threads write.
    scan_above, scan_tied = n_above.copy(), n_tied.copy()
    offset = 1
    while offset < threads:
        reads = [
            (scan_above[t - offset], scan_tied[t - offset]) if t >= offset else (0, 0)
            for t in range(threads)
        ]
        for t, (a, b) in enumerate(reads):
            scan_above[t] += a
            scan_tied[t] += b
        offset <<= 1
    quota = budget - int(scan_above[threads - 1])

    # Phase 3: each thread walks its run again and writes survivors to their slots.
    keep_rows = np.full(budget, -1, dtype=np.int64)
    for t, (lo, hi) in enumerate(runs):
        above_before = int(scan_above[t] - n_above[t])
        tied_before = int(scan_tied[t] - n_tied[t])
        for i in range(lo, hi):
            r = rank(scores[i], i, L, n_sink, recent)
            if r > th:
                slot = above_before + min(tied_before, quota)
                _write(keep_rows, slot, i, budget)
                above_before += 1
            elif r == th:
                if tied_before < quota:
                    _write(keep_rows, above_before + tied_before, i, budget)
                tied_before += 1
    if (keep_rows < 0).any():
        raise RuntimeError(f"slots {np.flatnonzero(keep_rows < 0).tolist()} were never written")
    return keep_rows


def _write(keep_rows: np.ndarray, slot: int, row: int, budget: int) -> None:
    if not 0 <= slot < budget or keep_rows[slot] >= 0:
        raise RuntimeError(f"row {row} written to slot {slot}: out of range or taken")
    keep_rows[slot] = row


def fused_evict_model(
    keys: np.ndarray,
    values: np.ndarray,
    scores: np.ndarray,
    *,
    budget: int,
    n_sink: int,
    recent: int,
    threads: int = DEFAULT_THREADS,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The whole GPU path: host threshold, then one modelled threadgroup per group.

    Args:
        keys: ``(G, L, D)``; values: ``(G, L, Dv)``; scores: ``(G, L)`` float32.
    Returns:
        ``(G, budget, D)``, ``(G, budget, Dv)``, ``(G, budget)``.
    """
    thresh = threshold(scores, budget=budget, n_sink=n_sink, recent=recent)
    G = scores.shape[0]
    idx = np.stack(
        [
            threadgroup_keep_rows(
                scores[g], thresh[g], budget=budget, n_sink=n_sink, recent=recent, threads=threads
            )
            for g in range(G)
        ]
    )  # (G, budget)
    # Phase 4: the strided copy loop reads row keep_rows[slot] into slot, which is this gather.
    take = np.arange(G)[:, None]
    return keys[take, idx], values[take, idx], scores[take, idx]
