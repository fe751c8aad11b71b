"""Capture post-RoPE query vectors from any mlx-lm model, sampled to a bounded size per head.

mlx-lm's attention rotates queries and keys with ``self_attn.rope(x, offset=cache.offset)``
just before attention, so what the rope returns for the queries is exactly the query the
model attends with, carrying the same rotation as the keys stored in its cache. We swap each
layer's ``rope`` for a wrapper that returns the same result and keeps a uniform random
sample of the rotated queries, then put the original back (even on error). No mlx-lm file
is edited.

Which rope call rotates the queries: under grouped-query attention it is the call with
``n_heads`` heads; with as many KV heads as query heads, mlx-lm's attention blocks always
rotate queries first, then keys, so it is the first of each pair.

Sampling is reservoir sampling by random priority: every token gets a uniform priority and
each layer keeps the ``samples_per_head`` tokens with the smallest ones, which is a uniform
sample without replacement of everything seen. All heads of a layer share the sampled
positions. Tokens that cannot enter the reservoir are never copied out of the graph.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from qfserve.calibrations.model_info import attention_modules, head_counts

DEFAULT_SAMPLES_PER_HEAD = 3000


@dataclass(frozen=True)
class QuerySample:
    """Sampled post-RoPE queries of one layer.

    Attributes:
        queries: ``(H, N, D)`` float32, H query heads, N sampled tokens (all heads share them).
        positions: ``(N,)`` the RoPE position each sampled query was rotated at.
        tokens_seen: Tokens the layer has processed in total (N <= tokens_seen).
    """

    queries: np.ndarray
    positions: np.ndarray
    tokens_seen: int


def _positions(offset: Any, batch: int, length: int) -> np.ndarray:
    """``(B, L)`` RoPE positions for a block rotated at ``offset`` (int, scalar or per row)."""
    if isinstance(offset, mx.array):
        offset = np.array(offset).astype(np.int64)
    base = np.broadcast_to(np.asarray(offset, dtype=np.int64).reshape(-1, 1), (batch, 1))
    return base + np.arange(length, dtype=np.int64)[None, :]


class Reservoir:
    """The ``capacity`` lowest-priority tokens of one layer: queries, positions, priorities."""

    def __init__(self, capacity: int, rng: np.random.Generator):
        self.capacity = capacity
        self.rng = rng
        self.priority = np.empty(0)
        self.queries: np.ndarray | None = None  # (H, N, D)
        self.positions = np.empty(0, dtype=np.int64)
        self.tokens_seen = 0
        self._pending: list[tuple[np.ndarray, mx.array, np.ndarray]] = []

    def threshold(self) -> float:
        # Only a priority below the current capacity-th smallest can still get in.
        if len(self.priority) < self.capacity:
            return np.inf
        return float(self.priority.max())

    def offer(self, queries: mx.array, positions: np.ndarray) -> None:
        """Queue the candidates of one block; ``queries`` ``(B, H, L, D)``, ``positions`` ``(B, L)``."""
        B, H, L, D = queries.shape
        priority = self.rng.random(B * L)
        self.tokens_seen += B * L
        chosen = np.flatnonzero(priority < self.threshold())
        if len(chosen) > self.capacity:
            chosen = chosen[np.argpartition(priority[chosen], self.capacity - 1)[: self.capacity]]
        if len(chosen) == 0:
            return
        flat = queries.transpose(1, 0, 2, 3).reshape(H, B * L, D)  # (H, B*L, D)
        picked = mx.take(flat, mx.array(chosen.astype(np.int32)), axis=1).astype(mx.float32)
        self._pending.append((priority[chosen], picked, positions.reshape(-1)[chosen]))

    def pending_arrays(self) -> list[mx.array]:
        return [p[1] for p in self._pending]

    def merge(self) -> None:
        """Fold evaluated candidates into the reservoir, keeping the lowest priorities."""
        if not self._pending:
            return
        prio = [self.priority] + [p[0] for p in self._pending]
        pos = [self.positions] + [p[2] for p in self._pending]
        new = [np.array(p[1]) for p in self._pending]
        queries = np.concatenate(new if self.queries is None else [self.queries, *new], axis=1)
        self._pending = []
        priority, positions = np.concatenate(prio), np.concatenate(pos)
        if len(priority) > self.capacity:
            keep = np.argpartition(priority, self.capacity - 1)[: self.capacity]
            priority, positions, queries = priority[keep], positions[keep], queries[:, keep]
        self.priority, self.positions, self.queries = priority, positions, queries


class QueryRoPE(nn.Module):
    """Calls the wrapped rope unchanged and hands each rotated query block to ``on_queries``.

    Args:
        rope: The layer's ``self_attn.rope``.
        on_queries: Called as ``on_queries(rotated, offset)`` with the rotated queries
            ``(B, n_heads, L, D)`` and the offset they were rotated at (int or per row).
        n_heads: Query heads of the layer.
        n_kv_heads: KV heads of the layer.
    """

    def __init__(
        self,
        rope: Any,
        on_queries: Callable[[mx.array, Any], None],
        n_heads: int,
        n_kv_heads: int,
    ):
        super().__init__()
        self.inner = rope
        self._on_queries = on_queries
        self._n_heads = n_heads
        self._gqa = n_heads != n_kv_heads
        self._calls = 0

    def __call__(self, x: mx.array, *args: Any, **kwargs: Any) -> mx.array:
        out = self.inner(x, *args, **kwargs)
        is_query = x.shape[1] == self._n_heads if self._gqa else self._calls % 2 == 0
        self._calls += 1
        if is_query:
            if x.ndim != 4 or x.shape[1] != self._n_heads:
                raise RuntimeError(
                    f"expected rotated queries of shape (B, n_heads={self._n_heads}, L, D), "
                    f"got {tuple(x.shape)}; this attention block rotates in another order"
                )
            self._on_queries(out, kwargs.get("offset", args[0] if args else 0))
        return out

    def rotated(self, queries: mx.array, offset: Any) -> None:
        """Hand over queries the wrapped rope's own arithmetic rotated elsewhere (a fused
        decode step rotates them in its native op), as a call would have."""
        self._on_queries(queries, offset)


def offer_to(reservoir: Reservoir) -> Callable[[mx.array, Any], None]:
    def offer(queries: mx.array, offset: Any) -> None:
        reservoir.offer(queries, _positions(offset, queries.shape[0], queries.shape[2]))

    return offer


class QueryCapture:
    """Context manager that samples every layer's post-RoPE queries while the model runs.

    Example::

        with QueryCapture(model, samples_per_head=3000) as capture:
            for tokens in batches:
                model(tokens)
                capture.flush()
        samples = capture.samples()  # one QuerySample per layer

    Args:
        model: Any mlx-lm model whose layers have ``self_attn.rope``.
        samples_per_head: Tokens kept per layer (shared by its heads). Default: 3000.
        seed: Seed of the sampling priorities.

    Raises:
        ValueError: ``samples_per_head`` < 1, or the model's attention has no ``rope``.
    """

    def __init__(
        self, model: nn.Module, *, samples_per_head: int = DEFAULT_SAMPLES_PER_HEAD, seed: int = 0
    ):
        if samples_per_head < 1:
            raise ValueError(f"samples_per_head must be >= 1, got {samples_per_head}")
        self.model = model
        self._attn = attention_modules(model)
        for i, attn in enumerate(self._attn):
            if not callable(getattr(attn, "rope", None)):
                raise ValueError(
                    f"layer {i}: {type(attn).__name__} has no `rope` to capture queries from"
                )
        seeds = np.random.SeedSequence(seed).spawn(len(self._attn))
        self._reservoirs = [Reservoir(samples_per_head, np.random.default_rng(s)) for s in seeds]
        self._originals: list[Any] = []

    def __enter__(self) -> QueryCapture:
        try:
            for attn, reservoir in zip(self._attn, self._reservoirs, strict=True):
                n_heads, n_kv_heads, _ = head_counts(attn, self.model)
                self._originals.append(attn.rope)
                attn.rope = QueryRoPE(attn.rope, offer_to(reservoir), n_heads, n_kv_heads)
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self._restore()

    def _restore(self) -> None:
        for attn, rope in zip(self._attn, self._originals, strict=False):
            attn.rope = rope
        self._originals = []

    def flush(self) -> None:
        """Evaluate the queued candidates of the last forward pass and fold them in.

        Call after each forward pass; only the sampled rows are evaluated, so the model's
        logits (and anything else not needed for them) are never computed.
        """
        mx.eval([a for r in self._reservoirs for a in r.pending_arrays()])
        for reservoir in self._reservoirs:
            reservoir.merge()

    def samples(self) -> list[QuerySample]:
        """One :class:`QuerySample` per layer (tokens in no particular order)."""
        self.flush()
        out = []
        for attn, r in zip(self._attn, self._reservoirs, strict=True):
            n_heads, _, head_dim = head_counts(attn, self.model)
            queries = r.queries if r.queries is not None else np.zeros((n_heads, 0, head_dim))
            out.append(QuerySample(queries.astype(np.float32), r.positions.copy(), r.tokens_seen))
        return out


def capture_queries(
    model: nn.Module,
    sequences: Iterable[Sequence[int]],
    *,
    samples_per_head: int = DEFAULT_SAMPLES_PER_HEAD,
    chunk_size: int | None = None,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> list[QuerySample]:
    """Run ``model`` over token sequences and sample its post-RoPE queries per layer.

    Each sequence is a fresh context (positions start at 0). With ``chunk_size`` a sequence
    is prefilled in blocks through the model's own cache, so blocks after the first are
    rotated at ``offset > 0`` exactly as in serving.

    Args:
        model: Any mlx-lm model.
        sequences: Token id sequences, one context each.
        samples_per_head: Tokens kept per layer and head. Default: 3000.
        chunk_size: Prefill block size; ``None`` runs each sequence in one block.
        seed: Seed of the sampling.
        progress: Called with the number of tokens after each block.

    Returns:
        One :class:`QuerySample` per layer, queries ``(n_heads, N, head_dim)``.

    Raises:
        ValueError: ``chunk_size`` < 1 or an empty sequence.
    """
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 or None, got {chunk_size}")
    with QueryCapture(model, samples_per_head=samples_per_head, seed=seed) as capture:
        for i, seq in enumerate(sequences):
            if len(seq) == 0:
                raise ValueError(f"sequences[{i}] is empty")
            tokens = mx.array(np.asarray(seq, dtype=np.int32))[None]  # (1, L)
            step = chunk_size or tokens.shape[1]
            cache = make_prompt_cache(model) if step < tokens.shape[1] else None
            for start in range(0, tokens.shape[1], step):
                block = tokens[:, start : start + step]
                model(block, cache=cache)
                if cache is not None:  # later blocks attend to these keys
                    mx.eval([c.state for c in cache])
                capture.flush()
                if progress is not None:
                    progress(block.shape[1])
        return capture.samples()
