"""One layer's cache for a decode batch: every request keeps its own cache, stepped together.

mlx-lm batches requests through batch caches (``BatchKVCache``: one padded tensor, left
padding, ``merge``/``filter``/``extend``/``extract``), and its ``GenerationBatch`` drives
any cache with that protocol. A padded tensor cannot express what qfserve's requests need:
each one evicts with its own method, budget, recent window, sinks and filters, so their row
counts, slot layouts and eviction steps all differ. :class:`BatchCache` therefore keeps the
members' own caches (:class:`qfserve.engine.kv.cache.EvictionCache`, ``FullKVCache`` or whatever the
model uses) and, per decode step, lets each member update and evict exactly as it would
alone (O(budget) per request), then right-pads their rows to the longest for one batched
attention. Padding is masked per KV head through ``head_mask``
(:mod:`qfserve.engine.kv.attention`), together with any member's own ragged-head mask.

That general path costs a copy of the batch's kept rows per layer and step (the padding),
and some twenty small MLX operations per member; on a CPU their dispatch, not the bytes,
is what grows with the batch. So while every member is a cache whose decode step it knows
(eviction caches whose score it knows, chunked or not, and full caches), the batch
holds their rows in one set of arrays (:class:`qfserve.engine.kv.batch.PackedBatch`) and steps them
with the same few operations whatever its size. Members leave and join it there (a gather
or a concatenation per array); a member that cannot be packed joining makes every member
take its rows back and the batch step each on its own.

A batch whose members hold very different row counts (a long prompt joining short chats) is
*ragged* (:func:`ragged`): padding every member to the longest would copy and attend the
longest member's row count once per member (a 8k-token request joining 8 short streams made their
next step take 6.6 s on SmolLM2). Then each member steps its own cache and attends its own
rows (:meth:`BatchCache.attend`, which the attention hook calls), one attention call per
member instead of one padded call.

Only decode steps (one new token per member) go through a batch: prompts are prefilled per
request, on its own caches, and join the batch when done (:mod:`qfserve.engine.serving.scheduler`).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from qfserve.engine.kv.attention import attend_one
from qfserve.engine.kv.batch.packed import PackedBatch, can_pack, pad_slots

# Ragged: the longest member holds more than RAGGED_FACTOR times the (lower) median member's
# rows plus RAGGED_SLACK (a mixed batch of 120-720-token prompts is not ragged).
RAGGED_FACTOR = 4
RAGGED_SLACK = 1024


def ragged(members: list[Any]) -> bool:
    """Whether padding ``members`` to the longest would mostly be padding (see the module
    doc)."""
    if len(members) < 2:
        return False
    sizes = sorted(m.size() for m in members)
    median = sizes[(len(sizes) - 1) // 2]  # the lower one: a long member and a short one
    return bool(sizes[-1] > RAGGED_FACTOR * median + RAGGED_SLACK)


class BatchCache:
    """The caches of one layer for every member of a decode batch, in batch order."""

    def __init__(self, members: list[Any]) -> None:
        self.members = members
        self.head_mask: mx.array | None = None  # (B, H, S) bool over the rows last returned
        self._packed: PackedBatch | None = None
        # A ragged step's rows, member by member (keys, values, head mask), for attend().
        self._rows: list[tuple[mx.array, mx.array, mx.array | None]] | None = None

    @classmethod
    def merge(cls, caches: list[Any]) -> BatchCache:
        """mlx-lm's constructor name for a batch of single-request caches."""
        members: list[Any] = []
        for c in caches:
            members.extend(c.members if isinstance(c, BatchCache) else [c])
        return cls(members)

    @property
    def offset(self) -> Any:
        """Each member's absolute position: ``(B,)`` int32, which RoPE takes per row."""
        if len(self.members) == 1:
            return self.members[0].offset
        return mx.array([m.offset for m in self.members], dtype=mx.int32)

    def _unpack(self) -> None:
        """Members get their own rows back (before the batch's membership changes)."""
        if self._packed is not None:
            self._packed.release()
            self._packed = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """One decode step: ``keys``/``values`` ``(B, H, 1, D)``, one row per member."""
        if keys.shape[2] != 1:
            raise ValueError(
                f"a batch cache takes decode steps only (one row per member), got {keys.shape[2]}"
            )
        self._rows = None
        uneven = ragged(self.members)
        if self._packed is not None and (self._packed.detached or uneven):  # extracted, or
            self._unpack()  # a long member among short ones
        if self._packed is None and not uneven and all(can_pack(m) for m in self.members):
            self._packed = PackedBatch(self.members)
        if self._packed is not None:
            k, v, self.head_mask = self._packed.step(keys, values)
            return k, v
        outs: list[tuple[mx.array, mx.array]] = []
        for i, m in enumerate(self.members):
            tap = getattr(getattr(m, "scorer", None), "tap", None)
            if tap is not None:  # a scorer that reads queries sees its own request's row
                tap.narrow(i)
            outs.append(m.update_and_fetch(keys[i : i + 1], values[i : i + 1]))
        masks = [getattr(m, "head_mask", None) for m in self.members]
        if uneven:  # each member attends its own rows (attend); the first's stand in
            self._rows = [(k, v, hm) for (k, v), hm in zip(outs, masks, strict=True)]
            self.head_mask = None
            return outs[0]
        if len(outs) == 1:
            self.head_mask = masks[0]
            return outs[0]
        S = max(k.shape[2] for k, _ in outs)
        if all(k.shape[2] == S for k, _ in outs) and all(m is None for m in masks):
            self.head_mask = None
            return (
                mx.concatenate([k for k, _ in outs], axis=0),
                mx.concatenate([v for _, v in outs], axis=0),
            )
        ks, vs, hms = [], [], []
        for (k, v), hm in zip(outs, masks, strict=True):
            real = mx.ones(k.shape[:3], dtype=mx.bool_) if hm is None else hm
            ks.append(pad_slots(k, S))
            vs.append(pad_slots(v, S))
            hms.append(pad_slots(real, S))
        self.head_mask = mx.concatenate(hms, axis=0)
        return mx.concatenate(ks, axis=0), mx.concatenate(vs, axis=0)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None) -> Any:
        # A decode row sees every row its member returns; padding goes through head_mask.
        return None

    @property
    def attend(self) -> Any:
        """After a ragged step, the attention of each member's query over its own rows (the
        attention hook calls it in place of attention over the returned rows); else
        ``None``."""
        return None if self._rows is None else self._attend_members

    def _attend_members(
        self, queries: mx.array, keys: Any, values: Any, scale: float, mask: Any, sinks: Any = None
    ) -> mx.array:
        assert self._rows is not None
        outs = [
            attend_one(queries[i : i + 1], k, v, scale, hm, sinks)
            for i, (k, v, hm) in enumerate(self._rows)
        ]
        return mx.concatenate(outs, axis=0)

    # -- mlx-lm's batch protocol -----------------------------------------------------------

    def filter(self, batch_indices: list[int]) -> None:
        self._rows = None  # a ragged step's rows are the last step's members'
        if self._packed is not None:
            if not batch_indices or self._packed.detached & set(batch_indices):
                self._unpack()  # an extracted member stays: the batch repacks at its next step
            else:
                self._packed.filter(batch_indices)
        self.members = [self.members[i] for i in batch_indices]

    def extend(self, other: BatchCache) -> None:
        self._rows = None
        packed = self._packed
        even = not ragged(self.members + other.members)  # else the next step unpacks
        if packed is not None and not packed.detached and other.members and even:
            if other._packed is None and all(can_pack(m) for m in other.members):
                other._packed = PackedBatch(other.members)
            if other._packed is not None and not other._packed.detached:
                packed.extend(other._packed)
                other._packed = None
                self.members.extend(other.members)
                return
        self._unpack()
        other._unpack()
        self.members.extend(other.members)

    def extract(self, idx: int) -> Any:
        """Member ``idx``, holding its own rows (mlx-lm extracts a finished request's cache,
        then filters it out)."""
        if self._packed is not None:
            self._packed.detach(idx)
        return self.members[idx]

    def size(self) -> int:
        return max((m.size() for m in self.members), default=0)

    def empty(self) -> bool:
        return all(m.empty() for m in self.members)

    @property
    def state(self) -> tuple[mx.array, ...]:
        """Every member's arrays (what ``mx.eval`` needs to materialise the batch)."""
        if self._packed is not None:
            return self._packed.state
        return tuple(a for m in self.members for a in m.state)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.members)

    def is_trimmable(self) -> bool:
        return False
