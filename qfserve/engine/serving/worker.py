"""The one thread that owns the model: a bounded FIFO of requests, batched as they come.

Handlers on the asyncio event loop call :meth:`Worker.submit` and await the job's events;
the worker thread loads the model, admits queued requests while the batch has room
(``max_batch``) and their KV memory fits (:mod:`qfserve.engine.serving.admission`), steps them
together (:mod:`qfserve.engine.serving.scheduler`) and posts events back with
``loop.call_soon_threadsafe``. MLX is only ever evaluated on this thread. Launched over several ranks, every rank runs this loop in
lockstep (:mod:`qfserve.engine.serving.lockstep`); only rank 0's takes HTTP requests.

The worker also keeps a record per request (counts only, never prompt text or token ids)
for the admin endpoint: the active ones and a bounded history of finished ones.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal

from qfserve.calibrations.artifact import CalibrationError
from qfserve.engine.filters.model import ModelFilters
from qfserve.engine.kv.methods import MethodContext
from qfserve.engine.models.loading import LoadedModel, load_model
from qfserve.engine.serving import startup
from qfserve.engine.serving.admission import Admitter
from qfserve.engine.serving.config import EngineConfig
from qfserve.engine.serving.intake import Intake
from qfserve.engine.serving.jobs import Job, WorkerUnavailable
from qfserve.engine.serving.records import Ledger
from qfserve.engine.serving.turns import Turns
from qfserve.engine.text.requests import Failed, GenerationRequest

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
        self.prompt_cache: Turns | None = None  # built on the thread, after the model
        self._loader = loader
        self.calibration: ModelFilters | None = None  # built on the thread
        self.ledger = Ledger(config.history)
        self._intake = Intake(config.max_queue, self.ledger)
        self.admitter = Admitter(self.ledger, max_kv_bytes, config)
        self._stopping = threading.Event()
        self._draining = False
        self._thread = threading.Thread(target=self._main, name="qfserve-worker", daemon=True)
        self._scheduler: Any = None  # serving.scheduler.Scheduler, built on the thread
        self.status: Literal["loading", "ready", "failed", "dead", "stopped"] = "loading"
        self.error: str | None = None
        # A file the model thread refused at start-up (a calibration that must not be used):
        # the process exits 2 with this one line, as for a model file it cannot read.
        self.refused: str | None = None
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
        return self.admitter.max_kv_bytes

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def ready(self) -> bool:
        return self.status == "ready" and self._thread.is_alive()

    def queue_length(self) -> int:
        return len(self._intake)

    @property
    def filter_source(self) -> str:
        """Where the Q-Filters come from (``"none"`` before the model is loaded)."""
        return "none" if self.calibration is None else self.calibration.source

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
        deferred = self.lockstep is not None  # cancelled at a step boundary, on every rank
        return self._intake.put(request, loop, self.loaded.name, request_id, deferred=deferred)

    def snapshot(self) -> dict[str, Any]:
        """Active and recent requests plus totals, as plain dicts (counts only)."""
        snap = self.ledger.snapshot()
        totals = snap["totals"]
        totals["max_batch"], totals["max_kv_bytes"] = self.max_batch, self.max_kv_bytes
        totals["kv_reserved_bytes"] = self.admitter.reserved()
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
            if isinstance(exc, CalibrationError):
                self.refused = str(exc)  # said once, by whoever stops the process
            else:
                logger.error("could not load the model: %s", self.error)
            self._fail_waiting("the model failed to load")
            return
        if self.status == "loading":  # not dead already (a rank lost at start-up)
            self.status = "ready"
        try:
            while not self._stopping.is_set():
                if self.lockstep is not None and self._sync(idle=not len(scheduler)):
                    break  # rank 0 stops: every rank leaves at this same tick
                self.admitter.admit(scheduler, self.max_batch, self._take, wait=not len(scheduler))
                if len(scheduler):
                    for left in scheduler.step():
                        self.admitter.close(left.record, left.state)
                        if left.turn is not None and self.prompt_cache is not None:
                            self.prompt_cache.keep(left.record.id, left.turn)
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
            self.admitter.forget()
            self._fail_waiting("the generation worker stopped")
            for job in self.ledger.live():  # admitted, or taken off the queue meanwhile
                self.admitter.fail(job, Failed("unavailable", "the generation worker stopped"))

    def _load(self) -> None:
        loaded, self.calibration, lockstep = startup.load(
            self.config, self._loader, self.max_kv_bytes, on_lost=self._lost
        )
        self.loaded, self.lockstep = loaded, lockstep
        self.ledger.serving(loaded)
        group = None
        if lockstep is not None:  # rank 0's limit on every rank; methods' passes agree
            self.admitter.max_kv_bytes, group = lockstep.max_kv_bytes, lockstep.group
        context = MethodContext(loaded.model, loaded.tokenizer, group)
        picked = startup.pick_method(self.config, self.calibration, lockstep)
        self.admitter.serve(loaded, context, self.calibration.caches_for, picked)

    def _make_scheduler(self) -> Any:
        assert self.loaded is not None and self.calibration is not None
        self.prompt_cache = self.admitter.turns = Turns.open(
            self.config,
            self.loaded.name,
            self.calibration,
            self._room,
            self.lockstep,
            self.max_kv_bytes,
        )
        scheduler, self.max_batch = startup.make_scheduler(
            self.loaded, self.config, self.prompt_cache, self.lockstep, self.max_batch
        )
        return scheduler

    def _fail_waiting(self, message: str) -> None:
        self._intake.clear(lambda job: self.admitter.fail(job, Failed("unavailable", message)))

    def _take(self, wait: bool) -> Job | None:
        """The next request to admit (``wait``: up to 0.2 s for one); under lockstep, the
        next the last tick brought, every rank alike."""
        return self._intake.take(wait) if self.lockstep is None else self.lockstep.take()

    def _sync(self, *, idle: bool) -> bool:
        """A step boundary under lockstep; whether every rank stops here (the tick says)."""
        assert self.lockstep is not None
        kept = self.prompt_cache.nbytes if self.prompt_cache is not None else 0
        held = (self.ledger.active_kv_bytes()[0], kept)
        room = self.max_batch - len(self._scheduler) - self.admitter.waiting
        stop = self.lockstep.sync(
            self._intake.queue,
            self.ledger,
            held,
            room=room,
            idle=idle,
            max_backlog=self.config.max_backlog,
            stopping=self._stopping.is_set(),
        )
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
        return (self.max_kv_bytes - self.admitter.reserved()) // ranks
