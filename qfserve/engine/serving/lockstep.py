"""Lockstep serving over an ``mx.distributed`` group: rank 0 decides, every rank steps.

Started under ``mlx.launch`` (or with the environment it sets), every rank loads the model
and splits it over the group (:mod:`qfserve.engine.models.sharding`); rank 0 alone serves
HTTP. Each rank runs the same :class:`~qfserve.engine.serving.worker.Worker` loop over the
same scheduler, so their forward passes meet in the sharded projections' collectives. What
only rank 0 sees is handed to the others at each step boundary as a :class:`Tick`: the
requests that arrived and the cancellations that take effect (a client that went away or
stopped reading). Everything else the loop decides (admission by KV memory, prefill chunks,
reuse, structured output, sampling from a shared seed) is computed from the same inputs on
every rank, so it comes out the same; this is mlx-lm's server's way (it shares each request
with the other ranks), carried to every step of continuous batching.

Each rank evicts its own KV heads' rows: ``--max-kv-bytes`` and admission count the whole
model's bytes (the sum over ranks), and ``/admin/cache`` shows what each rank holds.

A rank that dies is noticed through a connection of its own to rank 0
(:mod:`qfserve.engine.serving.liveness`): rank 0's worker fails its requests and ``/health``
says 503; when rank 0 dies, the followers exit.
Ticks are pickled: the ranks trust each other, as ``mx.distributed`` itself does.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import pickle
import queue
import random
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx
import numpy as np
from mlx_lm.generate import generation_stream

from qfserve.engine.serving.jobs import Job
from qfserve.engine.serving.liveness import LAUNCH_VARIABLES, Link, Watch
from qfserve.engine.serving.records import RequestRecord
from qfserve.engine.text.requests import Failed, GenerationRequest

if TYPE_CHECKING:
    from qfserve.engine.filters.model import ModelFilters
    from qfserve.engine.models.loading import LoadedModel
    from qfserve.engine.serving.records import Ledger

logger = logging.getLogger(__name__)


class PeerLost(RuntimeError):
    """Another rank stopped answering (its process died or its connection closed)."""


def distributed_group() -> Any | None:
    """The ``mx.distributed`` group this process was launched in, or ``None`` alone."""
    if not any(os.environ.get(name) for name in LAUNCH_VARIABLES):
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None


@dataclass(frozen=True)
class Handshake:
    """What rank 0 tells the others once, after every rank has loaded the model."""

    model: str
    agreed: dict[str, str]  # what must be equal on every rank: weights, filters, settings
    seed: int
    port: int  # where rank 0 listens for the followers' liveness connections


@dataclass(frozen=True)
class Tick:
    """What rank 0 alone knows at a step boundary: requests that arrived (with their ids)
    and cancellations taking effect now (with what their clients are told)."""

    arrivals: tuple[tuple[str, GenerationRequest], ...] = ()
    cancels: tuple[tuple[str, Failed | None], ...] = ()
    stop: bool = False  # rank 0 is stopping: leave the loop


@dataclass
class Lockstep:
    """One rank's side of the lockstep (built and used on the model thread only).

    Args:
        group: The ``mx.distributed`` group (more than one rank).
    """

    group: Any
    model: str = ""  # the served name, on every rank's records
    max_kv_bytes: int = 0  # the smallest of the ranks' limits, agreed at the handshake
    inbox: deque[Job] = field(default_factory=deque)  # arrived, not yet taken by admission
    known: dict[str, Job] = field(default_factory=dict)  # arrived and not finished
    # Per rank, from the last tick: (KV bytes its running requests hold, its kept caches').
    rank_bytes: list[tuple[int, int]] = field(default_factory=list)
    link: Link | None = None  # a follower's liveness connection to rank 0
    watch: Watch | None = None  # rank 0's watch over the followers' connections
    stopped: bool = False  # the stop tick went out (rank 0) or came in
    stopping: threading.Event = field(default_factory=threading.Event)  # set with stopped

    @classmethod
    def join(
        cls,
        loaded: LoadedModel,
        calibration: ModelFilters,
        max_kv_bytes: int,
        on_lost: Callable[[str], None],
        settings: str = "",
    ) -> Lockstep | None:
        """Split the model and its filters over the launched group and agree with rank 0
        (``None``: this process runs alone). Every rank calls this at load; on rank 0,
        ``on_lost`` is told (once, from another thread) when a follower dies. ``settings``
        are the engine settings every decision reads: they must be equal on every rank."""
        group = distributed_group()
        if group is None:
            return None
        from qfserve.engine.models.sharding import shard

        filters = calibration.filters
        digest = (
            "none" if filters is None else hashlib.sha1(np.array(filters).tobytes()).hexdigest()
        )
        agreed = {
            "weights": calibration.fingerprint,
            "settings": settings,
            "filters": f"{calibration.source} {digest}",
        }
        # The filters were resolved (and checked) against the whole model: split them too.
        calibration.shard(group.rank(), group.size())
        shard(loaded, group)
        self = cls(group, loaded.name)
        watch = Watch(self.size - 1, on_lost) if self.leader else None
        self.handshake(loaded.name, agreed, max_kv_bytes, watch.port if watch else 0)
        self.watch = watch
        logger.info("rank %d of %d: %s split over the group", self.rank, self.size, loaded.name)
        return self

    @property
    def rank(self) -> int:
        return int(self.group.rank())

    @property
    def size(self) -> int:
        return int(self.group.size())

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def handshake(
        self, model: str, agreed: dict[str, str], max_kv_bytes: int, port: int = 0
    ) -> None:
        """Agree with rank 0 on the model, its filters and the settings (``agreed``: every
        rank refuses to start, together, when one differs), take the smallest memory limit of
        any rank and rank 0's random seed, and (followers) connect to rank 0's ``port``."""
        mine = Handshake(model, agreed, random.getrandbits(62), port)
        data = self._share(pickle.dumps(mine), (max_kv_bytes, 0))
        assert data is not None  # rank 0 always sends one
        theirs: Handshake = pickle.loads(data)
        self.max_kv_bytes = min(limit for limit, _ in self.rank_bytes)
        differ = [k for k in agreed if theirs.agreed.get(k) != agreed[k]]
        if theirs.model != model:
            differ.insert(0, f"model ({model}, rank 0: {theirs.model})")
        if differ:
            logger.error("rank %d differs from rank 0 in: %s", self.rank, ", ".join(differ))
        else:
            if not self.leader:
                self.link = Link(theirs.port, self.rank, self.stopping)
        self._share(None, (int(bool(differ)), 0))  # every rank learns who differs
        bad = [rank for rank, (flag, _) in enumerate(self.rank_bytes) if flag]
        if bad:
            raise RuntimeError(
                f"rank(s) {', '.join(map(str, bad))} loaded another model, other filters or "
                "other settings than rank 0 (their logs say which): start every rank on the same "
                "model and flags"
            )
        mx.random.seed(theirs.seed)

    def ring(self) -> None:
        """Rank 0: wake the followers for the tick it is about to send."""
        if self.watch is not None:
            self.watch.ring()

    def same_everywhere(self, text: str) -> bool:
        """Whether ``text`` is the same on every rank (every rank learns the answer)."""
        mine = int.from_bytes(hashlib.sha1(text.encode()).digest()[:7], "big")
        self._share(None, (mine, 0))
        return len({digest for digest, _ in self.rank_bytes}) == 1

    def tick(self, tick: Tick | None, held: tuple[int, int]) -> Tick:
        """Rank 0 hands ``tick`` to every rank; the others receive it (``tick`` ``None``).
        ``held`` is this rank's (running, kept) KV bytes, gathered into :attr:`rank_bytes`."""
        payload = None if tick is None or tick == Tick() else pickle.dumps(tick)
        data = self._share(payload, held)
        return Tick() if data is None else pickle.loads(data)

    def _share(self, payload: bytes | None, held: tuple[int, int]) -> bytes | None:
        # One all_gather carries the payload's size and every rank's KV bytes; the payload
        # follows as an all_sum to which only rank 0 adds (mlx-lm's server shares requests so).
        size = len(payload) if self.leader and payload is not None else 0
        # On the generation stream: mlx-lm's batch queues its next step's forward (and the
        # sharded projections' collectives) asynchronously; the tick must come after them,
        # in the same order on every rank.
        with mx.stream(generation_stream):
            return self._share_on_stream(payload, size, held)

    def _share_on_stream(
        self, payload: bytes | None, size: int, held: tuple[int, int]
    ) -> bytes | None:
        try:
            head = mx.distributed.all_gather(
                mx.array([size, *held], dtype=mx.int64), group=self.group
            )
            rows = np.array(head).reshape(self.size, 3)  # (ranks, [size, running, kept])
            self.rank_bytes = [(int(r[1]), int(r[2])) for r in rows]
            size = int(rows[0, 0])
            if size == 0:
                return None
            buffer = (
                mx.array(np.frombuffer(payload, dtype=np.uint8))
                if self.leader and payload is not None
                else mx.zeros((size,), dtype=mx.uint8)
            )
            data = mx.distributed.all_sum(buffer, group=self.group)
            mx.eval(data)
        except RuntimeError as exc:  # the ring backend's "connection to a peer was lost"
            raise PeerLost(f"a rank of {self.size} stopped answering ({exc})") from exc
        return bytes(np.array(data, copy=False).tobytes())

    def sync(
        self,
        requests: queue.Queue[Job],
        ledger: Ledger,
        held: tuple[int, int],
        *,
        room: int,
        idle: bool,
        max_backlog: int,
        stopping: bool = False,
    ) -> bool:
        """A step boundary: rank 0 takes what arrived on ``requests``, as many as admission
        has ``room`` for beside the ones waiting (the rest stay queued, where ``max_queue``
        bounds them), ``idle``: waiting up to 0.2 s for the first, and hands them, with the cancellations due and whether it is
        ``stopping``, to every rank; followers open their copies in ``ledger``. Returns
        whether rank 0 is stopping: then every rank leaves its loop at this tick."""
        if self.leader:
            arrived: list[Job] = []
            take = room - len(self.inbox)
            with contextlib.suppress(queue.Empty):
                if idle and take > 0:
                    arrived.append(requests.get(timeout=0.2))
                while len(arrived) < take:
                    arrived.append(requests.get_nowait())
            due = self.cancels_due(max_backlog)
            self.ring()
            tick = self.tick(Tick(tuple((j.id, j.request) for j in arrived), due, stopping), held)
        else:
            if self.link is not None:
                self.link.wait()  # asleep, not spinning in the collective
            tick = self.tick(None, held)
            arrived = []
            for job_id, request in tick.arrivals:  # a follower's copy: nobody listens to it
                record = RequestRecord.opened(
                    job_id, self.model, request.kind, request.cache.method
                )
                arrived.append(Job(request, record, None, deferred=True))
                ledger.open(arrived[-1])
        self.apply(tick, arrived)
        if tick.stop:
            self.stopping.set()  # rank 0 will close its connection: not a death
            self.stopped = True
        return tick.stop

    def leave(self, *, clean: bool) -> None:
        """Rank 0 is leaving its loop: a ``clean`` stop tells the others with a tick (unless
        one already did); a model thread that died of its own error closes their
        connections instead, so they exit rather than wait on a collective that never comes."""
        if self.stopped:
            return
        self.stopped = True
        if not clean:
            if self.watch is not None:
                self.watch.close()
            return
        with contextlib.suppress(PeerLost):
            self.ring()
            self.tick(Tick(stop=True), (0, 0))

    def cancels_due(self, max_backlog: int) -> tuple[tuple[str, Failed | None], ...]:
        """Rank 0: the cancellations to apply at this step (asked for by a handler, or a
        client that stopped reading), applied here to its own jobs."""
        due = []
        for job_id, job in self.known.items():
            if job.cancelled:
                continue
            if not job.cancel_asked and job.backlog > max_backlog:
                logger.warning("request %s: its client stopped reading; cancelled", job_id)
                job.cancel(Failed("cancelled", "the client stopped reading the stream"))
            if job.cancel_asked:
                job.apply_cancel()
                due.append((job_id, job.failure))
        return tuple(due)

    def apply(self, tick: Tick, arrived: list[Job]) -> None:
        """Every rank: queue the arrivals (``arrived``, built from the tick on followers) for
        admission and apply the cancellations; forget the requests that finished."""
        for job in arrived:
            self.known[job.id] = job
            self.inbox.append(job)
        for job_id, failure in tick.cancels:
            if job_id in self.known:
                self.known[job_id].apply_cancel(failure)
        for job_id in [i for i, job in self.known.items() if job.record.finished is not None]:
            del self.known[job_id]

    def take(self) -> Job | None:
        """The next arrived request for admission (never blocks: the tick waited)."""
        return self.inbox.popleft() if self.inbox else None

    def view(self) -> dict[str, Any]:
        """What ``/admin/cache`` shows of the ranks."""
        running = [r[0] for r in self.rank_bytes]
        kept = [r[1] for r in self.rank_bytes]
        return {
            "ranks": self.size,
            "per_rank": [
                {"rank": i, "running_kv_bytes": a, "kept_kv_bytes": b}
                for i, (a, b) in enumerate(self.rank_bytes)
            ],
            "total": {"running_kv_bytes": sum(running), "kept_kv_bytes": sum(kept)},
        }
