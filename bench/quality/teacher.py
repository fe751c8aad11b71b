"""Teacher-forced log-likelihood through the real caches, one token per step.

Generation is what eviction has to survive: each token is predicted from what the cache kept
of everything before it. :func:`streaming_nll` feeds a batch of sequences through caches
from :func:`qfserve.engine.kv.factory.make_caches` one token per step, the way decoding does. The first
``prefill`` tokens go in as one block, which stores exactly what token-by-token feeding would
(nothing is evicted while the cache holds at most ``budget`` rows, and the key-SVD fallback
has not frozen yet before ``calib_tokens`` keys): see :func:`prefill_length`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

from bench.quality.arms import check_budget, kept_rows


def token_nll(logits: mx.array, targets: mx.array) -> mx.array:
    """``(B, N)`` negative log-likelihood of ``targets`` ``(B, N)`` under ``logits`` ``(B, N, V)``."""
    logits = logits.astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return -mx.take_along_axis(logprobs, targets[..., None], axis=-1).squeeze(-1)


def full_nll(model: Any, tokens: np.ndarray) -> np.ndarray:
    """``(B, L-1)`` next-token NLL with a full cache (one forward pass over ``(B, L)``)."""
    x = mx.array(tokens.astype(np.int32))
    nll = token_nll(model(x[:, :-1]), x[:, 1:])
    return np.array(nll)


def prefill_length(budget: int | None, calib_tokens: int | None) -> int:
    """Tokens that can go in as one block without changing what the cache stores."""
    if budget is None:
        return 1 << 30
    if calib_tokens is None:
        return budget
    return min(budget, calib_tokens - 1)


def streaming_nll(
    model: Any,
    tokens: np.ndarray,
    caches: list[Any],
    *,
    budget: int | None,
    prefill: int,
    block: int | None = None,
    on_step: Callable[[int], None] | None = None,
) -> tuple[np.ndarray, int]:
    """Next-token NLL ``(B, L-1)`` with ``caches`` fed one token per step after ``prefill``.

    Args:
        tokens: ``(B, L)`` token ids.
        budget: The arm's budget (``None`` for the full arm): checked after every step.
        prefill: Leading tokens fed before the single steps (see :func:`prefill_length`).
        block: Feed those in blocks of this many tokens, as a server reads a prompt (each
            block may evict: block evictions are where chunked selection and adaptive
            budgets act); ``None``: one block.
        on_step: Called with the number of tokens fed after each step.
    Returns:
        The NLL and the most rows any layer held at any step.
    Raises:
        RuntimeError: a layer ever held more than ``budget`` rows, or fewer at the end.
    """
    B, L = tokens.shape
    x = mx.array(tokens.astype(np.int32))
    prefill = max(1, min(prefill, L - 1))
    out, max_rows = [], 0
    for s in range(0, prefill, block or prefill):
        e = min(prefill, s + (block or prefill))
        out.append(token_nll(model(x[:, s:e], cache=caches), x[:, s + 1 : e + 1]))
        mx.eval(out[-1])
        max_rows = max(max_rows, *kept_rows(caches)) if budget is not None else e
        if budget is not None and max_rows > budget:
            raise RuntimeError(f"budget violated: a layer held {max_rows} rows > {budget}")
        if on_step is not None:
            on_step(e - s)
    for i in range(prefill, L - 1):
        step = token_nll(model(x[:, i : i + 1], cache=caches), x[:, i + 1 : i + 2])
        mx.eval(step)
        out.append(step)
        max_rows = max(max_rows, *kept_rows(caches)) if budget is not None else i + 1
        if budget is not None and max_rows > budget:
            raise RuntimeError(f"budget violated: a layer held {max_rows} rows > {budget}")
        if on_step is not None:
            on_step(1)
    check_budget(caches, budget, L - 1)
    return np.array(mx.concatenate(out, axis=1)), max_rows
