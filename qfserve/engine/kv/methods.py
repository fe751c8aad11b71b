"""What a method needs beyond a score: one policy per request, called by serving at fixed points.

Most methods are a scorer and nothing else: the eviction core keeps the best-scored rows
and batching, admission and reuse carry them unchanged. Some need more from the server:
KVzip must reserve the memory of a pass over the prompt, run that pass before decoding (or
whenever a prompt read under memory pressure reaches its limit), and compress a turn before
it is kept. Such behaviour lives in the method's :class:`Policy`, which serving calls
without knowing the method:

=========================  ================================================================
:meth:`Policy.reserve`     admission: the KV bytes the request must reserve (and, where the
                           method can use more, the larger reservation it would prefer)
:meth:`Policy.admitted`    admission: which of the two was granted
:meth:`Policy.after_read`  the scheduler, after each prefill chunk that leaves more to read
:meth:`Policy.before_decode`  the scheduler, once the prompt is read
:meth:`Policy.after_step`  the scheduler, after each decode step of the request
:meth:`Policy.before_keep` the scheduler, before a finished turn is kept for reuse
=========================  ================================================================

The policy is built over the request's caches, fresh or restored from a kept turn
(:func:`policy_for`), so a restored cache's state is what it reads. Work a hook returns
(:class:`Work`) is stepped by the scheduler between decode steps, ``limit`` tokens at a
time, as a prefill chunk is. A method adds a policy by subclassing :class:`Policy` and
naming it in :data:`POLICIES`; everything else gets the plain one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.memory import kv_need, need_param


class Work(Protocol):
    """Method work the scheduler runs in slices between decode steps."""

    @property
    def done(self) -> bool: ...

    def step(self, limit: int) -> int:
        """Do about ``limit`` tokens' worth; return the tokens done."""
        ...


@dataclass(frozen=True)
class Reservation:
    """The KV bytes a request reserves.

    Args:
        need: What it must reserve to run at all.
        param: The setting that sets ``need`` (a :class:`CacheConfig` field or
            ``max_tokens``): what an error asks the client to lower.
        prefer: Bytes for a better way to run, taken only where they fit beside the
            running requests (``None``: there is none); :meth:`Policy.admitted` is told.
    """

    need: int
    param: str
    prefer: int | None = None


@dataclass
class MethodContext:
    """What a policy may use of the serving model: the model, its tokenizer, the ranks it is
    split over, and a place to keep what a method builds once per model (``memo``)."""

    model: Any
    tokenizer: Any
    group: Any = None
    memo: dict[str, Any] = field(default_factory=dict)

    def once(self, key: str, build: Callable[[], Any]) -> Any:
        """``build()``'s result, built the first time ``key`` is asked for."""
        if key not in self.memo:
            self.memo[key] = build()
        return self.memo[key]


class Policy:
    """The plain policy: a request's caches hold their settings' bound, and nothing runs
    besides prefill and decode.

    Args:
        config: The settings the request runs with.
        caches: Its caches (fresh, or restored from a kept turn).
        context: The serving model.
    """

    def __init__(self, config: CacheConfig, caches: list[Any], context: MethodContext) -> None:
        self.config = config
        self.caches = caches
        self.context = context

    @classmethod
    def reserved_rows(cls, budget: int, config: CacheConfig, prefill_chunk: int) -> int:
        """The rows a head reserves, on average over the layers and heads, for a request of
        ``config`` at ``budget``: the budget (a head holds at most its own)."""
        return budget

    @classmethod
    def largest_budget(cls, rows: int, config: CacheConfig, prefill_chunk: int) -> int:
        """The largest budget whose :meth:`reserved_rows` are at most ``rows`` (0: none)."""
        low, high = 0, max(0, rows)
        while low < high:  # reserved_rows grows with the budget
            mid = (low + high + 1) // 2
            if cls.reserved_rows(mid, config, prefill_chunk) <= rows:
                low = mid
            else:
                high = mid - 1
        return low

    def reserve(
        self,
        loaded: Any,
        prompt_tokens: int,
        max_tokens: int,
        *,
        max_kv_bytes: int,
        prefill_chunk: int,
        kept: bool,
    ) -> Reservation:
        """What the request reserves (``loaded``: the model and its ``config``; ``kept``:
        the turn will be kept for reuse): its caches' bound at :meth:`reserved_rows`."""
        config = self.config
        rows = self.reserved_rows(config.budget, config, prefill_chunk)
        if rows != config.budget:
            config = replace(config, budget=rows)
        return Reservation(kv_need(loaded, config, prompt_tokens, max_tokens), need_param(config))

    def admitted(self, preferred: bool) -> None:
        """Admission granted :attr:`Reservation.prefer` (``True``) or ``need``."""

    def after_read(self, tokens: Sequence[int]) -> Work | None:
        """The caches hold ``tokens`` and the prompt goes on: work to run before reading on."""
        return None

    def before_decode(self, tokens: Sequence[int]) -> Work | None:
        """The caches hold the prompt but its last token (``tokens``): work to run before
        the request decodes."""
        return None

    def after_step(self, steps: int) -> None:
        """The request's ``steps``-th decode step wrote its row, and the next has not begun
        (its caches are its own between steps: a batch that packs their rows packs only
        caches whose scorer has a batched form)."""

    def before_keep(self, tokens: Sequence[int]) -> None:
        """The turn ends normally and is kept for reuse; its caches hold ``tokens``."""


def _kvzip() -> type[Policy]:
    from qfserve.engine.kv.kvzip.policy import KVzipPolicy

    return KVzipPolicy


def _kvzap() -> type[Policy]:
    from qfserve.engine.kv.kvzap import KVzapPolicy

    return KVzapPolicy


# Methods whose policy is not the plain one (loaded when first asked for).
POLICIES: dict[str, Callable[[], type[Policy]]] = {"kvzip": _kvzip, "kvzap": _kvzap}


def policy_class(method: str) -> type[Policy]:
    """The policy class of ``method``."""
    make = POLICIES.get(method)
    return Policy if make is None else make()


def policy_for(config: CacheConfig, caches: list[Any], context: MethodContext) -> Policy:
    """The policy of a request running ``config`` on ``caches``."""
    return policy_class(config.method)(config, caches, context)
