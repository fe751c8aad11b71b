"""The decode step of a whole batch in one set of arrays: :class:`PackedBatch`.

Stepping every member's own cache (:class:`qfserve.engine.kv.batch.BatchCache`'s general
path) costs about twenty small MLX operations per member, layer and step, and on a CPU their
dispatch outweighs the step's arithmetic. Here the members' rows live in one right-padded set
of arrays while the membership holds still, and a step is one call whatever the batch size
(:func:`qfserve.engine.kv.evict.write_and_select`, native where built): score the new rows
(each member by its scorer's batched form, :meth:`qfserve.engine.kv.scorers.Scorer.form`),
write each into its member's next slot, pick each evicting member's victim (its own sinks,
recent window and held slots). Each cache keeps the rows it keeps alone, in the same slots
(to float32 rounding: design.md). Per member, ``held`` slots are in use: a cache still growing
(fewer than ``budget + 1`` rows, or a full cache) appends at slot ``held``; once ``budget +
1`` slots are held it is in the slot layout of :mod:`qfserve.engine.kv.slots`.

While packed a member is *lent*: its arrays are :class:`Lent` placeholders with their shape
and size but no data (statistics stay current, rows are not held twice, computing with them
fails loudly); :meth:`PackedBatch.release` writes the real rows back, copied. Members that
track positions (chunks, or a request asking what was kept) decode as alone: per-token scores
beside the ranks, true positions in ``order``; chunked ones rank their stored rows by chunk
once at the budget, a decoded row by its own score.
What can be packed: eviction caches with heads not ragged and a scorer with a batched form,
and mlx-lm's ``KVCache`` (our ``FullKVCache``); any other batch steps each member alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from qfserve.engine.kv.batch.lent import Lent
from qfserve.engine.kv.cache import EvictionCache, FullKVCache
from qfserve.engine.kv.evict import chunk_scores, select_victim, write_and_select
from qfserve.engine.kv.scorers import ScoreForm

_INF = float("inf")
_STEP = 256  # slots added at a time when a growing member needs more (as mlx-lm's KVCache)
_NONE = "none"  # a member that does not evict (a full cache) scores nothing
_MAX_SLOTS = 2**31 - 1  # int32's largest: a full cache's cap in the step


def can_pack(cache: Any) -> bool:
    """Whether :class:`PackedBatch` can step this cache (one sequence, decode steps)."""
    if type(cache) in (KVCache, FullKVCache):
        return cache.keys is not None and cache.keys.shape[0] == 1
    if type(cache) is not EvictionCache:
        return False
    return (
        cache.keys is not None
        and cache.keys.shape[0] == 1
        and cache.scores is not None
        and (not cache.tracks or cache.token_scores is not None and cache.positions is not None)
        and cache.valid is None
        and (form := cache.scorer.form()) is not None
        and form.kind != "hidden"  # a decode row's own hidden state: scored alone
    )


def _arrays(cache: Any) -> list[mx.array]:
    names = ("keys", "values", "scores", "order", "free", "token_scores", "positions")
    return [a for a in (getattr(cache, n, None) for n in names) if isinstance(a, mx.array)]


def stack_slots(parts: list[mx.array], rows: int) -> mx.array:
    """Parts ``(B_i, H, S_i, ...)`` stacked along the batch axis (0), each zero-padded to
    ``rows`` slots.

    Why not ``concatenate`` of :func:`pad_slots`: that writes every part twice (its padded
    copy, then the concatenation), and MLX's CPU copies of padded strided blocks are slow: a
    long prompt joining a batch of short ones spent ~3 s over 30 layers there. One zeroed
    array written into takes about half the time."""
    if len(parts) == 1:
        return pad_slots(parts[0], rows)
    first = parts[0]
    shape = (sum(p.shape[0] for p in parts), first.shape[1], rows, *first.shape[3:])
    out = mx.zeros(shape, dtype=first.dtype)
    at = 0
    for p in parts:
        out[at : at + p.shape[0], :, : p.shape[2]] = p
        at += p.shape[0]
    return out


def pad_slots(x: mx.array, rows: int) -> mx.array:
    """Zero rows appended along the slot axis (axis 2) up to ``rows``."""
    if x.shape[2] == rows:
        return x
    widths = [(0, 0)] * x.ndim
    widths[2] = (0, rows - x.shape[2])
    return mx.pad(x, widths)


@dataclass
class _Member:
    """What the packed step keeps of one member beside the shared arrays."""

    cache: Any
    cap: float  # slots it holds at most: budget + 1 where it evicts, else unbounded
    held: int  # slots in use
    chunk: int  # 1, or the chunk its stored rows rank by at the budget
    form: ScoreForm | None  # its scorer's batched form; None: it scores nothing

    @property
    def tracked(self) -> bool:
        """Per-token scores and true positions are kept (chunks, or a request asked)."""
        return bool(getattr(self.cache, "tracks", False))

    @property
    def evicts(self) -> bool:
        return self.cap != _INF

    def needed(self) -> int:
        """Slots it needs for its next row: room to grow by whole steps, up to its
        ``budget + 1`` (a large budget on a short request reserves nothing it does not use)."""
        grown = -(-(self.held + 1) // _STEP) * _STEP
        return int(min(self.cap, grown))


class PackedBatch:
    """One layer's caches of a decode batch, held in shared arrays (see the module doc).

    ``rows`` keeps one :class:`_Member` per member, in batch order, beside the arrays.
    """

    def __init__(self, members: list[Any]) -> None:
        if not members or not all(can_pack(m) for m in members):
            raise ValueError("every member must be a packable cache (see can_pack)")
        self.rows: list[_Member] = []
        keys: list[Any] = []
        values: list[Any] = []
        scores: list[Any] = []
        order: list[Any] = []
        free: list[Any] = []
        tokens: list[Any] = []  # per-token scores (the ranks but for tracked members)
        for m in members:
            member, arrays = _taken(m)
            self.rows.append(member)
            for out, array in zip((keys, values, scores, order, free, tokens), arrays, strict=True):
                out.append(array)
        C = max(r.needed() for r in self.rows)
        self.keys = stack_slots(keys, C)  # (B, H, C, D)
        self.values = stack_slots(values, C)  # (B, H, C, Dv)
        self.scores = stack_slots(scores, C)  # (B, H, C) raw
        self.order = stack_slots(order, C)  # (B, H, C) int32
        self.free = mx.concatenate(free)  # (B, H, 1) uint32: where each next row goes
        self.token_scores = None  # (B, H, C) raw per-token scores, with tracked members only
        if self._tracked:
            self.token_scores = stack_slots(tokens, C)
        self.detached: set[int] = set()  # members already given their rows (extract)
        self._set_members()
        for r in self.rows:
            self._lend(r)

    @property
    def members(self) -> list[Any]:
        """The members' caches, in batch order."""
        return [r.cache for r in self.rows]

    @property
    def _tracked(self) -> bool:
        return any(r.tracked for r in self.rows)

    def _set_members(self) -> None:
        """The per-member constants of the step, from the member records."""
        self._set_scoring([r.form for r in self.rows])
        caches = self.members
        self.n_sink = mx.array([getattr(m, "n_sink", 0) for m in caches], mx.int32)[:, None, None]
        self.recent = mx.array([getattr(m, "recent", 0) for m in caches], mx.int32)[:, None, None]
        caps = [min(r.cap, _MAX_SLOTS) for r in self.rows]  # a full cache never evicts
        self.cap_slots = mx.array(caps, mx.int32)[:, None, None]

    def _set_scoring(self, forms: list[ScoreForm | None]) -> None:
        kinds = [_NONE if f is None else f.kind for f in forms]
        self.kinds = sorted(set(kinds))
        codes = {kind: i for i, kind in enumerate(self.kinds)}
        self.kind = mx.array([codes[k] for k in kinds], dtype=mx.int32)[:, None, None]
        self.projection: ScoreForm | None = None  # members' (H, D) directions, stacked
        if "project" in self.kinds:
            H, D = self.keys.shape[1], self.keys.shape[3]
            zero, one = mx.zeros((H, D), dtype=mx.float32), mx.ones((H, 1), dtype=mx.float32)
            dirs = [
                zero if f is None or f.direction is None else f.direction.reshape(H, D)
                for f in forms
            ]
            scaled = any(f is not None and f.scale is not None for f in forms)
            scales = mx.stack([one if f is None or f.scale is None else f.scale for f in forms])
            self.projection = ScoreForm("project", mx.stack(dirs), scales if scaled else None)

    def _score(self, keys: mx.array, positions: mx.array) -> mx.array:
        """``(B, H, 1)`` float32 scores of the new rows, each by its member's formula."""
        k = keys if keys.dtype == mx.float32 else keys.astype(mx.float32)
        parts = {}
        if "project" in self.kinds:
            assert self.projection is not None
            parts["project"] = self.projection.projected(k)
        if "norm" in self.kinds:
            parts["norm"] = -mx.sqrt(mx.square(k).sum(axis=-1))
        if "position" in self.kinds:
            parts["position"] = mx.broadcast_to(positions.astype(mx.float32), k.shape[:3])
        if _NONE in self.kinds:
            parts[_NONE] = mx.zeros(k.shape[:3], dtype=mx.float32)
        out = parts[self.kinds[0]]
        for code, kind in enumerate(self.kinds[1:], start=1):
            out = mx.where(self.kind == code, parts[kind], out)
        return out

    def step(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array, Any]:
        """Write one row per member; return every slot and the mask of the held ones.

        Args:
            keys: ``(B, H, 1, D)``; values ``(B, H, 1, Dv)``.
        Returns:
            ``(keys, values, head_mask)``: ``(B, H, W, D)``, ``(B, H, W, Dv)``, and
            ``(B, 1, W)`` bool (None when every member holds all ``W`` slots), where ``W``
            is the most slots any member holds.
        """
        if self.detached:
            raise ValueError("a member was given its rows back: filter the batch first")
        C = max(r.needed() for r in self.rows)
        if C > self.keys.shape[2]:  # a growing member needs more slots
            self.keys, self.values = pad_slots(self.keys, C), pad_slots(self.values, C)
            self.scores, self.order = pad_slots(self.scores, C), pad_slots(self.order, C)
            if self.token_scores is not None:
                self.token_scores = pad_slots(self.token_scores, C)
        C = self.keys.shape[2]
        offsets = [r.cache.offset for r in self.rows]  # each member's next position
        positions = mx.array(offsets, dtype=mx.int32)[:, None, None]  # (B, 1, 1)
        held = [int(min(r.held + 1, r.cap)) for r in self.rows]
        held_now = mx.array(held, dtype=mx.int32)[:, None, None]
        evict = [h == r.cap for h, r in zip(held, self.rows, strict=True)]
        # A chunked member reaching its budget ranks its stored rows by chunk before the
        # selection (_write_and_grow); every other step is one call (native where built),
        # whose victim a member still growing does not take.
        reaching = [
            r.chunk > 1 and r.held < r.cap == h for r, h in zip(self.rows, held, strict=True)
        ]
        if self.token_scores is None or not any(reaching):
            state = (self.keys, self.values, self.scores, self.order, self.free)
            tokens_off = self.token_scores is None
            # A projection is scored in the step, where no per-token scores need it apart.
            form = self.projection if self.kinds == ["project"] and tokens_off else None
            row = (keys, values, self._score(keys, positions) if form is None else form)
            first_recent = positions + 1 - self.recent
            # A growing member's next slot is its next one; the step computes it too, so each
            # step evaluates the last one's scores (kept lazy, they would chain to the end).
            out = write_and_select(
                *state,
                row,
                positions,
                first_recent,
                self.n_sink,
                held_now,
                ranked=False,
                token_scores=self.token_scores,
                caps=self.cap_slots,
            )
            self.keys, self.values, self.scores, self.order, self.free, *tokens = out
            self.token_scores = tokens[0] if tokens else None
        else:
            score = self._score(keys, positions)
            self._write_and_grow(keys, values, score, positions, reaching, held_now, evict)
        for r, now, evicted in zip(self.rows, held, evict, strict=True):
            r.cache.offset += 1
            if evicted:
                r.cache.evictions += 1
            if now != r.held:
                r.held = now
                self._lend(r)
        # Attention reads the slots some member holds, not the room grown ahead of them (a
        # growing member reserves whole steps of slots: reading them all would double the
        # width of a batch whose caches just passed a step).
        width = max(held)
        mask = None if all(h == width for h in held) else mx.arange(width) < held_now
        if width == C:
            return self.keys, self.values, mask
        return self.keys[:, :, :width], self.values[:, :, :width], mask

    def _write_and_grow(
        self,
        keys: mx.array,
        values: mx.array,
        score: mx.array,
        positions: mx.array,
        reaching: list[bool],
        held_now: mx.array,
        evict: list[bool],
    ) -> None:
        """A step where a chunked member reaches its budget (``reaching``): the writes, its
        stored rows ranked by chunk, then the selection."""
        assert self.token_scores is not None
        slot, free = self.free[..., None], self.free  # (B, H, 1, 1), (B, H, 1)
        self.keys = mx.put_along_axis(self.keys, slot, keys, axis=2)
        self.values = mx.put_along_axis(self.values, slot, values, axis=2)
        self.scores = mx.put_along_axis(self.scores, free, score, axis=2)
        self.token_scores = mx.put_along_axis(self.token_scores, free, score, axis=2)
        self.order = mx.put_along_axis(
            self.order, free, mx.broadcast_to(positions, free.shape), axis=2
        )
        for i, (r, ranks) in enumerate(zip(self.rows, reaching, strict=True)):
            if ranks:
                # Its stored rows (slots 0 .. n-1, in time) now rank by their chunk's mean;
                # the row just written at slot n keeps its own score.
                n = r.held
                self.scores[i : i + 1, :, :n] = chunk_scores(
                    self.token_scores[i : i + 1, :, :n], self.order[i : i + 1, :, :n], r.chunk
                )
        # Each row's own sinks, recent window and held slots; NaN ranks lowest.
        ranked = mx.nan_to_num(self.scores, nan=-_INF, posinf=_INF, neginf=-_INF)
        first_recent = positions + 1 - self.recent
        victim = select_victim(ranked, self.order, self.n_sink, first_recent, held_now)
        self.free = self._next_free(victim, held_now, evict)

    def _next_free(self, victim: mx.array, held_now: mx.array, evict: list[bool]) -> mx.array:
        """Each member's next slot: its victim where it evicts, else the next one it fills."""
        if all(evict):
            return victim
        grow = mx.broadcast_to(held_now.astype(mx.uint32), victim.shape)
        return grow if not any(evict) else mx.where(mx.array(evict)[:, None, None], victim, grow)

    def _lend(self, r: _Member) -> None:
        """A member's arrays become placeholders of the shapes it holds now."""
        m: Any = r.cache  # its arrays' annotations do not foresee a placeholder
        _, H, _, D = self.keys.shape
        m.keys = Lent((1, H, r.held, D), self.keys.dtype)
        m.values = Lent((1, H, r.held, self.values.shape[3]), self.values.dtype)
        if not r.evicts:  # a full cache has nothing else
            return
        m.scores = Lent((1, H, r.held), mx.float32)
        if r.tracked:
            m.token_scores = Lent((1, H, r.held), mx.float32)
            m.positions = Lent((1, H, r.held), mx.int32)
        if r.held == r.cap:  # the slot layout
            m.order = Lent((1, H, r.held), mx.int32)
            m.free = Lent((1, H, 1), mx.uint32)

    # Membership, mlx-lm's batch protocol: a finished member is extracted (its rows given back),
    # then the batch is filtered to the rest; newcomers join by extend. Done on the shared arrays
    # (one gather or concatenation per array), a change of membership costs a few
    # operations per layer instead of giving every member its rows back and packing anew.

    def detach(self, i: int) -> None:
        """Give member ``i`` its rows back; it stays in the arrays until :meth:`filter`
        drops it, and the batch must not step before then."""
        if i not in self.detached:
            self._give_back([i])
            self.detached.add(i)

    def filter(self, keep: list[int]) -> None:
        """Keep members ``keep``, in that order; the others get their rows back."""
        kept = set(keep)
        if self.detached & kept:  # checked before anyone is given their rows back
            raise ValueError("a detached member cannot stay in the batch")
        self._give_back([i for i in range(len(self.rows)) if i not in kept])
        if not keep:
            self.rows = []
            return
        idx = mx.array(keep, dtype=mx.int32)
        self.rows = [self.rows[i] for i in keep]
        C = max(r.needed() for r in self.rows)  # what the rest need, no more
        self.keys, self.values = self.keys[idx, :, :C], self.values[idx, :, :C]
        self.scores, self.order = self.scores[idx, :, :C], self.order[idx, :, :C]
        self.free = self.free[idx]
        if self.token_scores is not None:
            self.token_scores = self.token_scores[idx, :, :C] if self._tracked else None
        self.detached = set()
        self._set_members()

    def extend(self, other: PackedBatch) -> None:
        """Append ``other``'s members (it is used up: its members are lent to this batch)."""
        if self.detached or other.detached:
            raise ValueError("filter detached members out before extending")
        C = max(self.keys.shape[2], other.keys.shape[2])

        def join(a: mx.array, b: mx.array) -> mx.array:
            return stack_slots([a, b], C)

        if self.token_scores is not None or other.token_scores is not None:
            mine = self.scores if self.token_scores is None else self.token_scores
            theirs = other.scores if other.token_scores is None else other.token_scores
            self.token_scores = join(mine, theirs)
        self.keys, self.values = join(self.keys, other.keys), join(self.values, other.values)
        self.scores, self.order = join(self.scores, other.scores), join(self.order, other.order)
        self.free = mx.concatenate([self.free, other.free])
        self.rows.extend(other.rows)
        other.rows = []
        self._set_members()

    def release(self) -> None:
        """Give every member its rows back (copies) in the layout it would have alone."""
        self._give_back(range(len(self.rows)))
        self.rows = []

    def _give_back(self, which: Any) -> None:
        """Members ``which`` get their rows back (copies), as they would hold them alone.

        The copies are evaluated now, without waiting: until then each one would keep the
        whole batch's buffers alive (a finished request's caches may stay for a later turn).
        """
        given = []
        for i in which:
            if i in self.detached:
                continue
            r = self.rows[i]
            m = r.cache
            given.append(m)
            held = r.held

            def rows(x: mx.array, i: int = i, held: int = held) -> mx.array:
                return mx.contiguous(x[i : i + 1, :, :held])

            m.keys, m.values = rows(self.keys), rows(self.values)
            if not r.evicts:
                continue
            if r.tracked:
                assert self.token_scores is not None
                m.token_scores, m.positions = rows(self.token_scores), rows(self.order)
            if held == r.cap:
                m.scores = mx.nan_to_num(rows(self.scores), nan=-_INF, posinf=_INF, neginf=-_INF)
                m.order = m.positions if r.tracked else rows(self.order)
                m.free = mx.contiguous(self.free[i : i + 1])
            else:  # below its budget a chunked member's ranks are its token scores
                m.scores = rows(self.scores)
        mx.async_eval([a for m in given for a in _arrays(m)])

    @property
    def state(self) -> tuple[mx.array, ...]:
        extra = () if self.token_scores is None else (self.token_scores,)
        return self.keys, self.values, self.scores, self.order, self.free, *extra


def _taken(m: Any) -> tuple[_Member, tuple[Any, ...]]:
    """A member's record and its arrays in the packed layout: keys, values, ranks, order,
    next slot and per-token scores."""
    k, v = m.keys, m.values
    _, H, rows, _ = k.shape
    if not isinstance(m, EvictionCache):  # a full cache: grows, never evicts
        rows = m.offset
        k, v = k[..., :rows, :], v[..., :rows, :]
        zeros = mx.zeros((1, H, rows), dtype=mx.float32)
        order = mx.zeros((1, H, rows), dtype=mx.int32)
        free = mx.full((1, H, 1), rows, dtype=mx.uint32)
        return _Member(m, _INF, rows, 1, None), (k, v, zeros, order, free, zeros)
    s = m.scores
    t = m.token_scores if m.tracks else s
    if m.free is not None:  # slot layout: every slot is held, one is free
        o, f = m.order, m.free
    elif m.tracks:  # temporal order; chunks (and what was kept) need the true positions
        o, f = m.positions, mx.full((1, H, 1), rows, dtype=mx.uint32)
    else:  # temporal order: ranks in time as the slot layout would give them
        in_time = mx.arange(m.offset - rows, m.offset, dtype=mx.int32)
        o = mx.broadcast_to(in_time, (1, H, rows))
        f = mx.full((1, H, 1), rows, dtype=mx.uint32)
    form = m.scorer.form()
    assert form is not None  # can_pack checked it
    return _Member(m, m.budget + 1, rows, m.chunk, form), (k, v, s, o, f, t)
