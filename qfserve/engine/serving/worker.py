"""The one thread that owns the model: a bounded FIFO of requests, batched as they come.

Handlers on the asyncio event loop call :meth:`Worker.submit` and await the job's events;
the worker thread loads the model, admits queued requests while the batch has room
(``max_batch``), builds each one's eviction caches with ``make_caches``, steps them together
(:mod:`qfserve.engine.serving.scheduler`) and posts events back with ``loop.call_soon_threadsafe``. MLX is
only ever evaluated on this thread. Launched over several ranks, every rank runs this loop in
lockstep (:mod:`qfserve.engine.serving.lockstep`); only rank 0's takes HTTP requests.

The worker also keeps a record per request (counts only, never prompt text or token ids)
for the admin endpoint: the active ones and a bounded history of finished ones.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from qfserve.engine.filters.model import ModelFilters
from qfserve.engine.kv.config import ConfigError
from qfserve.engine.models.loading import LoadedModel, load_model
from qfserve.engine.serving import startup
from qfserve.engine.serving.admission import hold_need, prepare
from qfserve.engine.serving.config import EngineConfig
from qfserve.engine.serving.jobs import Admission, Job, KeptTurn, WorkerUnavailable
from qfserve.engine.serving.records import Ledger, RequestRecord
from qfserve.engine.text.prompts import PromptError
from qfserve.engine.text.requests import Failed, GenerationRequest, Started

if TYPE_CHECKING:
    from qfserve.engine.serving.lockstep import Lockstep

logger = logging.getLogger(__name__)


class Worker:
    """Owns the model on one thread; admits queued requests in FIFO order into one batch.

    Args:
        config: The model to load (on the thread) and the worker's limits (its fields say
            what each does). ``max_kv_bytes`` ``None`` is a share of physical memory
            (:mod:`qfserve.engine.serving.admission`); kept caches count too, and give way
            to running requests.
        loader: Replaces :func:`qfserve.engine.models.loading.load_model` (tests).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        *,
        loader: Callable[[str | None], LoadedModel] = load_model,
    ) -> None:
        config = self.config = config or EngineConfig()
        self.max_batch = config.max_batch
        max_kv_bytes = config.max_kv_bytes
        if max_kv_bytes is None:
            from qfserve.engine.serving.admission import default_max_kv_bytes

            max_kv_bytes = default_max_kv_bytes()
        self._next: Admission | None = None  # the oldest request, prepared, waiting for memory
        # Built on the thread (qfserve.engine.reuse.kept imports mlx-lm, which a start-up
        # check must not wait for).
        self.prompt_cache: Any = None  # qfserve.engine.reuse.kept.KeptCaches
        self._loader = loader
        self.calibration: ModelFilters | None = None  # built on the thread
        self._queue: queue.Queue[Job] = queue.Queue(maxsize=config.max_queue)
        self.ledger = Ledger(config.history, max_kv_bytes)
        self._ids = itertools.count(1)
        self._stopping = threading.Event()
        self._draining = False
        self._thread = threading.Thread(target=self._main, name="qfserve-worker", daemon=True)
        self._scheduler: Any = None  # serving.scheduler.Scheduler, built on the thread
        self.status: Literal["loading", "ready", "failed", "dead", "stopped"] = "loading"
        self.error: str | None = None
        self.loaded: LoadedModel | None = None
        self.started_at = int(time.time())
        self.lockstep: Lockstep | None = None  # set at load when launched over several ranks

    # -- life cycle (event loop side) ----------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Finish the running requests' current step, fail the waiting ones, join."""
        self._stopping.set()
        for job in self.ledger.live():
            job.cancel()
        self._thread.join(timeout)

    def alive(self) -> bool:
        """The worker thread is still running (``stop`` returns after its timeout regardless)."""
        return self._thread.is_alive()

    def drain(self) -> None:
        """Refuse new requests; the running and queued ones continue."""
        self._draining = True

    def abort_all(self, message: str) -> int:
        """Cancel every queued and running request, telling their clients ``message`` (503).

        Returns:
            How many requests were cancelled.
        """
        jobs = self.ledger.live()  # queued ones included: opened before they are queued
        failure = Failed("unavailable", message)
        aborted = 0
        for job in jobs:
            if job is not None and not job.cancelled:
                job.cancel(failure)
                aborted += 1
        return aborted

    def idle(self) -> bool:
        """Nothing queued or running."""
        return self.ledger.idle()

    @property
    def max_kv_bytes(self) -> int:
        return self.ledger.max_kv_bytes

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def ready(self) -> bool:
        return self.status == "ready" and self._thread.is_alive()

    def queue_length(self) -> int:
        return self._queue.qsize()

    @property
    def filter_source(self) -> str:
        """Where the Q-Filters come from (``"none"`` before the model is loaded)."""
        return "none" if self.calibration is None else self.calibration.source

    @property
    def fingerprint(self) -> str:
        """The model weights' fingerprint (``""`` before the model is loaded)."""
        return "" if self.calibration is None else self.calibration.fingerprint

    def submit(
        self,
        request: GenerationRequest,
        loop: asyncio.AbstractEventLoop,
        *,
        request_id: str | None = None,
    ) -> Job:
        """Queue a request; raises :class:`WorkerUnavailable` when it cannot be taken.

        Args:
            request: What to generate.
            loop: The event loop the job's events are posted to.
            request_id: Shown by :meth:`snapshot` (the response id); default: a counter.
        """
        if self._draining:
            raise WorkerUnavailable("the server is shutting down", retry_after=5)
        if not self.ready:
            if self.status == "loading":
                raise WorkerUnavailable("the model is still loading", retry_after=5)
            raise WorkerUnavailable(
                f"the generation worker is not running ({self.status}: {self.error})"
            )
        assert self.loaded is not None
        record = RequestRecord.opened(
            request_id or f"req-{next(self._ids)}", self.loaded.name, request.kind, request.cache
        )
        job = Job(request, record, loop, deferred=self.lockstep is not None)
        # Opened before it is queued: the worker may take it and close it at once.
        self.ledger.open(job)
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            self.ledger.discard(job)
            raise WorkerUnavailable(
                f"too many requests waiting ({self._queue.maxsize}); retry shortly",
                retry_after=1,
            ) from None
        return job

    def snapshot(self) -> dict[str, Any]:
        """Active and recent requests plus totals, as plain dicts (counts only)."""
        snap = self.ledger.snapshot()
        snap["totals"]["max_batch"] = self.max_batch
        kept = self.prompt_cache
        snap["prompt_cache"] = (
            {"enabled": self.config.prompt_cache_size > 0} if kept is None else kept.view
        )
        if self.lockstep is not None:
            snap["distributed"] = self.lockstep.view()
        return snap

    def active_kv_bytes(self) -> tuple[int, int]:
        """(kept, full-cache) bytes over the active requests."""
        return self.ledger.active_kv_bytes()

    # -- the worker thread ---------------------------------------------------------------

    def _main(self) -> None:
        try:
            self._load()
            scheduler = self._scheduler = self._make_scheduler()
        except BaseException as exc:  # noqa: BLE001 - report any load failure, then exit
            self.status, self.error = "failed", f"{type(exc).__name__}: {exc}"
            logger.error("could not load the model: %s", self.error)
            self._fail_waiting("the model failed to load")
            return
        if self.status == "loading":  # not dead already (a rank lost at start-up)
            self.status = "ready"
        try:
            while not self._stopping.is_set():
                if self.lockstep is not None and self._sync(idle=not len(scheduler)):
                    break  # rank 0 stops: every rank leaves at this same tick
                self._admit(wait=len(scheduler) == 0)
                if len(scheduler):
                    for left in scheduler.step():
                        self.ledger.close(left.record, left.state)
                        if left.turn is not None:
                            self._keep(left.record.id, left.turn)
                if self.calibration is not None and self.calibration.learning:
                    self.calibration.learn()
        except BaseException as exc:  # noqa: BLE001 - the thread dies; say why
            self.error = f"{type(exc).__name__}: {exc}"
            logger.exception("generation worker died")
            raise
        finally:
            if self.lockstep is not None and self.lockstep.leader:  # the others leave too
                self.lockstep.leave(clean=self._stopping.is_set())
            self.status = "stopped" if self._stopping.is_set() else "dead"
            scheduler.clear()
            self._next = None
            self._fail_waiting("the generation worker stopped")
            for job in self.ledger.live():  # admitted, or taken off the queue meanwhile
                job.emit(Failed("unavailable", "the generation worker stopped"))
                self.ledger.close(job.record, "error")

    def _load(self) -> None:
        self.loaded, self.calibration, self.lockstep = startup.load(
            self.config, self._loader, self.max_kv_bytes, on_lost=self._lost
        )
        self.ledger.serving(self.loaded, self.lockstep)

    def _make_scheduler(self) -> Any:
        assert self.loaded is not None and self.calibration is not None
        self.prompt_cache = startup.make_kept(  # saved turns are read back into fresh caches
            self.config, self.fingerprint, self.max_kv_bytes, self.lockstep,
            self.calibration.caches_for,
        )  # fmt: skip
        scheduler, self.max_batch = startup.make_scheduler(
            self.loaded, self.config, keeps=self.prompt_cache is not None,
            lockstep=self.lockstep, max_batch=self.max_batch,
        )  # fmt: skip
        return scheduler

    def _fail_waiting(self, message: str) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            job.emit(Failed("unavailable", message))
            self.ledger.close(job.record, "error")

    def _admit(self, *, wait: bool) -> None:
        """Move queued requests into the batch while it has room and their KV memory fits
        (``wait``: block briefly for the first, the batch being empty). The oldest request
        that does not fit yet waits for running ones to finish; none overtakes it."""
        scheduler = self._scheduler
        while len(scheduler) < self.max_batch:
            if self._next is None:
                job = self._take(wait)
                if job is None:
                    return
                wait = False
                self._next = self._start(job)
                if self._next is None:
                    continue
            admission = self._next
            job = admission.job
            if job.cancelled:
                self._next = None
                job.emit(job.failure or Failed("cancelled", "the request was cancelled"))
                self.ledger.close(job.record, "cancelled")
                continue
            full = None
            if self.prompt_cache is not None and job.request.reuse:
                # A kvzip turn kept for the next one answers on its full cache if it fits.
                full = hold_need(
                    self.loaded, job.request.cache, len(admission.prompt), admission.max_tokens
                )
            if full is not None and self.ledger.reserve(job.record, full, alone=False):
                from qfserve.engine.kv import kvzip

                # This turn answers on its full cache; kept, it is compressed.
                kvzip.hold(admission.caches)
            elif not self.ledger.reserve(job.record, admission.need, alone=not len(scheduler)):
                return
            self._next = None
            if self.prompt_cache is not None:  # kept caches give way to running requests
                self.prompt_cache.shrink(self._room())
            job.emit(Started(prompt_tokens=len(admission.prompt), max_tokens=admission.max_tokens))
            scheduler.add(admission)

    def _take(self, wait: bool) -> Job | None:
        """The next request to admit (``wait``: up to 0.2 s for one); under lockstep, the
        next the last tick brought, every rank alike."""
        if self.lockstep is not None:
            return self.lockstep.take()
        try:
            return self._queue.get(timeout=0.2) if wait else self._queue.get_nowait()
        except queue.Empty:
            return None

    def _sync(self, *, idle: bool) -> bool:
        """A step boundary under lockstep; whether every rank stops here (the tick says)."""
        assert self.lockstep is not None
        kept = self.prompt_cache.cache.nbytes if self.prompt_cache is not None else 0
        held = (self.ledger.active_kv_bytes()[0], kept)
        room = self.max_batch - len(self._scheduler) - (self._next is not None)
        stop = self.lockstep.sync(
            self._queue, self.ledger, held, room=room, idle=idle,
            max_backlog=self.config.max_backlog, stopping=self._stopping.is_set(),
        )  # fmt: skip
        if stop:
            self._stopping.set()
        return stop

    def _lost(self, message: str) -> None:
        """Another rank died (from the liveness thread): this model thread may wait forever
        on a collective, so the requests fail here, at once, and the worker is dead (unless
        it already failed to load, or stopped: then the server exits as it would alone)."""
        if self.status in ("failed", "stopped"):
            return
        self.status, self.error = "dead", message
        logger.error("%s: failing every request", message)
        for job in self.ledger.live():  # their records close if the thread comes back
            job.emit(Failed("unavailable", f"the model is split over ranks and {message}"))

    def _room(self) -> int:
        """KV bytes this rank's kept caches may hold beside the running requests (its share)."""
        ranks = 1 if self.lockstep is None else self.lockstep.size
        return (self.max_kv_bytes - self.ledger.reserved()) // ranks

    def _start(self, job: Job) -> Admission | None:
        """Encode the prompt, build the caches and size their KV memory (``None``: the job
        already ended, with its event sent)."""
        if job.cancelled:
            if job.failure is not None:
                job.emit(job.failure)
            self.ledger.close(job.record, "cancelled")
            return None
        assert self.loaded is not None and self.calibration is not None
        reuse = self.prompt_cache is not None and job.request.reuse
        try:
            return prepare(
                job,
                self.loaded,
                self.calibration.caches_for,
                self.prompt_cache.fetch if reuse else None,  # type: ignore[union-attr]
                self._cache_key,
                self.max_kv_bytes,
                self.config,
            )
        except (PromptError, ConfigError) as exc:  # ConfigError: settings this model cannot honour
            job.emit(Failed("invalid_request", str(exc), exc.param))
            self.ledger.close(job.record, "error")
            return None
        except Exception as exc:  # noqa: BLE001 - one request failing must not stop the worker
            logger.exception("request %s failed", job.id)
            job.emit(Failed("internal", f"generation failed: {type(exc).__name__}: {exc}"))
            self.ledger.close(job.record, "error")
            return None

    def _cache_key(self, request: GenerationRequest) -> tuple[Any, ...]:
        """What a kept cache must match for ``request`` to continue it (its settings and
        conversation name; :func:`qfserve.engine.reuse.kept.cache_key`)."""
        from qfserve.engine.reuse.kept import cache_key

        assert self.loaded is not None
        return cache_key(self.loaded.name, request.cache, self.filter_source, request.cache_name)

    def _keep(self, request_id: str, turn: KeptTurn) -> None:
        """A request ended normally: its caches stay for the next turn to continue (a
        failure to keep or save them is logged; the request itself is already done)."""
        if self.prompt_cache is None or not turn.request.reuse:
            return
        try:
            self.prompt_cache.keep(
                self._cache_key(turn.request), turn.tokens, turn.caches, self._room()
            )
        except Exception as exc:  # noqa: BLE001 - a cache not kept must not stop the worker
            logger.warning("request %s: its cache was not kept: %s", request_id, exc)
