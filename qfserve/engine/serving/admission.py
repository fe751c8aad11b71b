"""Admission by KV memory: a queued request made ready for the batch, once, on the worker.

:class:`Admitter` encodes the prompt, resolves an ``auto`` budget from its length
(:func:`resolve_auto`), builds or restores the caches and their method's policy
(:mod:`qfserve.engine.kv.methods`), and reserves the KV bytes the policy says they can hold
(:mod:`qfserve.engine.kv.memory`). A request is admitted only while the sum of what the
running ones can hold, plus its own, fits ``max_kv_bytes``; one that can never fit is refused
naming the setting to lower. Every request that ends before it runs ends through
:meth:`Admitter.fail`, and every reservation is freed by :meth:`Admitter.close`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from qfserve.engine.kv.config import (
    DEFAULT_METHOD,
    AutoSettings,
    CacheConfig,
    ConfigError,
    Method,
    default_recent,
    fit_budget_mode,
    fit_chunk,
)
from qfserve.engine.kv.memory import kv_need, kv_row_bytes, window_bytes
from qfserve.engine.kv.methods import MethodContext, policy_class, policy_for
from qfserve.engine.serving.jobs import Admission, Job
from qfserve.engine.text.prompts import PromptError, encode_prompt
from qfserve.engine.text.requests import Failed, Started

if TYPE_CHECKING:
    from qfserve.engine.serving.config import EngineConfig
    from qfserve.engine.serving.records import Ledger, RequestRecord, State
    from qfserve.engine.serving.turns import Turns

logger = logging.getLogger(__name__)

DEFAULT_KV_SHARE = 0.25  # of physical memory, when --max-kv-bytes is not given
# The smallest budget an auto request is evicted to, memory allowing: on SmolLM2 the
# needle study kept the full cache's answers at 2x and lost them from 8x (docs/eviction.md).
MIN_AUTO_BUDGET = 512


def default_max_kv_bytes() -> int:
    """A quarter of the machine's physical memory."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: 4 GiB
        total = 16 * 2**30
    return int(total * DEFAULT_KV_SHARE)


def resolve_auto(
    loaded: Any,
    template: CacheConfig,
    auto: AutoSettings,
    prompt_tokens: int,
    max_tokens: int,
    config: EngineConfig,
    max_kv_bytes: int,
    picked: Method,
) -> CacheConfig:
    """The settings a request whose budget follows memory runs with: every row (``full``)
    while its full cache fits ``max_kv_bytes``, so a user who sets nothing never gets a
    worse answer than the full cache while memory allows it.

    Beyond, its method (``picked`` where the server picks it, ``auto.method``: the served
    model's, see :meth:`Admitter.serve`, with the budget mode fitted to it unless sent), at
    the largest budget whose reservation
    (:meth:`qfserve.engine.kv.methods.Policy.reserved_rows`) fits the request's share
    (``max_kv_bytes / max_batch``, at least :data:`MIN_AUTO_BUDGET` rows a head where the
    memory holds them), a recent window of a quarter of it and a chunk fitted to it, unless
    the request sent them (``auto``, a :class:`qfserve.engine.kv.config.AutoSettings`)."""
    total = prompt_tokens + max_tokens
    full = dataclasses.replace(
        template,
        method="full",
        budget=max(total, 1),
        recent=0,
        chunk=1,
        budget_mode="per_head",
        positions=False,  # a full cache holds every row: nothing to track
    )
    if kv_need(loaded, full, prompt_tokens, max_tokens) <= max_kv_bytes:
        return full
    if auto.method and picked != template.method:
        mode = auto.budget_mode or fit_budget_mode(config.budget_mode, picked)
        template = dataclasses.replace(template, method=picked, budget_mode=mode, chunk=1)
    row = max(1, kv_row_bytes(loaded.model, loaded.config, template))
    room = max_kv_bytes - window_bytes(loaded.model, loaded.config, total)  # sliding layers'
    policy = policy_class(template.method)

    def budget_in(rows: int) -> int:  # - the decode step's free slot
        return policy.largest_budget(rows - 1, template, config.prefill_chunk)

    fits = budget_in(room // row)
    share = budget_in(room // max(1, config.max_batch) // row)
    budget = max(1, min(fits, max(share, MIN_AUTO_BUDGET)))
    recent = auto.recent if auto.recent is not None else default_recent(budget, template.n_sink)
    chunk = (
        auto.chunk if auto.chunk is not None else fit_chunk(config.chunk, template.method, budget)
    )
    return dataclasses.replace(template, budget=budget, recent=recent, chunk=chunk)


class Admitter:
    """Prepares queued requests for the batch and holds their KV reservations.

    Args:
        ledger: The records of live requests (closed here for requests that end).
        max_kv_bytes: What the running requests may reserve together.
        config: The engine's settings (the ``auto`` budget's share, prefill chunk).
    """

    def __init__(self, ledger: Ledger, max_kv_bytes: int, config: EngineConfig) -> None:
        self.ledger = ledger
        self.max_kv_bytes = max_kv_bytes
        self.config = config
        self.turns: Turns | None = None  # kept turns requests continue, where reuse is on
        self._lock = threading.Lock()
        self._reserved: dict[str, int] = {}
        self._next: Admission | None = None  # the oldest request, prepared, waiting for memory
        self._serving: tuple[Any, MethodContext, Callable[[CacheConfig], list[Any]]] | None = None
        self.picked: Method = DEFAULT_METHOD  # the method of requests that leave it to the server

    def serve(
        self,
        loaded: Any,
        context: MethodContext,
        caches_for: Callable[[CacheConfig], list[Any]],
        picked: Method = DEFAULT_METHOD,
    ) -> None:
        """Admit requests to ``loaded``, their caches built by ``caches_for``; ``picked``:
        the method of requests that leave it to the server (``--kv-method auto``)."""
        self._serving = (loaded, context, caches_for)
        self.picked = picked

    @property
    def waiting(self) -> int:
        """Requests prepared and waiting for memory (0 or 1: none overtakes the oldest)."""
        return int(self._next is not None)

    def admit(
        self, scheduler: Any, max_batch: int, take: Callable[[bool], Job | None], *, wait: bool
    ) -> None:
        """Move queued requests (``take``: the next, ``wait``: block briefly for the first)
        into ``scheduler``'s batch while it has room and their KV memory fits. The oldest
        request that does not fit yet waits for running ones to finish; none overtakes it."""
        while len(scheduler) < max_batch:
            if self._next is None:
                job = take(wait)
                if job is None:
                    return
                wait = False
                self._next = self.start(job)
                if self._next is None:
                    continue
            admission = self._next
            job = admission.job
            if job.cancelled:
                self._next = None
                self.cancel(job)
                continue
            if not self.reserve(admission, alone=not len(scheduler)):
                return
            self._next = None
            if self.turns is not None:  # kept caches give way to running requests
                self.turns.shrink()
            job.emit(Started(prompt_tokens=len(admission.prompt), max_tokens=admission.max_tokens))
            scheduler.add(admission)

    def forget(self) -> None:
        """Drop the request waiting for memory (the worker is stopping and tells it)."""
        self._next = None

    def start(self, job: Job) -> Admission | None:
        """``job`` made ready for the batch on the served model, or ``None`` with the job
        ended here (cancelled, its prompt cannot be encoded, its settings do not suit this
        model, or its caches can never fit)."""
        if job.cancelled:
            self.cancel(job)
            return None
        try:
            return self._prepare(job)
        except (PromptError, ConfigError) as exc:  # ConfigError: settings this model cannot honour
            self.fail(job, Failed("invalid_request", str(exc), exc.param))
        except Exception as exc:  # noqa: BLE001 - one request failing must not stop the worker
            logger.exception("request %s failed", job.id)
            self.fail(job, Failed("internal", f"generation failed: {type(exc).__name__}: {exc}"))
        return None

    def _prepare(self, job: Job) -> Admission:
        """Encode, resolve an ``auto`` budget, fetch (reuse on: from the kept turns) or build
        the caches and their policy, and size what they reserve."""
        assert self._serving is not None, "serve() first"
        loaded, context, caches_for = self._serving
        turns = self.turns if job.request.reuse else None
        request, config = job.request, self.config
        prompt, max_tokens = encode_prompt(loaded, request)
        job.record.prompt_tokens = len(prompt)
        if request.detail and len(prompt) > config.kv_detail_max_tokens:
            raise PromptError(
                f"kv_cache_detail reports on every prompt token: this prompt has {len(prompt)} "
                f"tokens, over the server's --kv-detail-max-tokens {config.kv_detail_max_tokens}",
                "kv_cache_detail",
            )
        cache = request.cache
        if request.auto is not None:  # what it left to the worker is resolved here, once
            cache = resolve_auto(
                loaded,
                cache,
                request.auto,
                len(prompt),
                max_tokens,
                config,
                self.max_kv_bytes,
                self.picked,
            )
            if request.cache.evicts and not cache.evicts:
                # Settings this model cannot honour are refused whether or not eviction runs.
                caches_for(request.cache)
        job.record.configure(cache)
        caches, cached = (
            (None, 0) if turns is None else turns.fetch(turns.key(request, cache), prompt)
        )
        if caches is None:
            caches = caches_for(cache)
        policy = policy_for(cache, caches, context)
        reservation = policy.reserve(
            loaded,
            len(prompt),
            max_tokens,
            max_kv_bytes=self.max_kv_bytes,
            prefill_chunk=config.prefill_chunk,
            kept=turns is not None,
        )
        if reservation.need > self.max_kv_bytes:
            raise PromptError(
                f"this request's KV cache can hold {reservation.need} bytes, more than the "
                f"server's --max-kv-bytes {self.max_kv_bytes}; lower "
                + ("its budget" if reservation.param == "budget" else reservation.param),
                reservation.param,
            )
        return Admission(job, prompt, max_tokens, cache, caches, policy, reservation, cached)

    def reserve(self, admission: Admission, *, alone: bool) -> bool:
        """Reserve the admission's KV bytes if they fit beside the others' (``alone``:
        nothing else runs, so it is admitted regardless): the preferred reservation where
        it fits, else the one it needs. Its policy is told which."""
        reservation = admission.reservation
        if reservation.prefer is not None and self._reserve(
            admission.job.record, reservation.prefer, alone=False
        ):
            admission.policy.admitted(True)
            return True
        if not self._reserve(admission.job.record, reservation.need, alone=alone):
            return False
        admission.policy.admitted(False)
        return True

    def _reserve(self, record: RequestRecord, need: int, *, alone: bool) -> bool:
        with self._lock:
            if not alone and sum(self._reserved.values()) + need > self.max_kv_bytes:
                return False
            self._reserved[record.id] = need
        record.kv_reserved_bytes = need
        return True

    def reserved(self) -> int:
        """KV bytes the admitted requests have reserved."""
        with self._lock:
            return sum(self._reserved.values())

    def close(self, record: RequestRecord, state: State) -> None:
        """The request ended in ``state``: its KV freed, its record closed."""
        with self._lock:
            self._reserved.pop(record.id, None)
        self.ledger.close(record, state)

    def fail(self, job: Job, event: Failed, state: State = "error") -> None:
        """Tell the client ``event`` and close the request in ``state``."""
        job.emit(event)
        self.close(job.record, state)

    def cancel(self, job: Job) -> None:
        """A cancelled request leaves before it runs: its client (if it still listens) is
        told why, as the scheduler tells one that leaves the batch."""
        self.fail(job, job.failure or Failed("cancelled", "the request was cancelled"), "cancelled")
