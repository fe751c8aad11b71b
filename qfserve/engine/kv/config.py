"""Eviction settings for one request: a frozen dataclass validated at construction."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, cast

Method = Literal["qfilters", "kvzip", "kvzap", "knorm", "streaming", "snapkv", "tova", "full"]
KernelMode = Literal["auto", "on", "off"]
BudgetMode = Literal["per_head", "adaptive", "global"]

METHODS: tuple[str, ...] = (
    "qfilters",
    "kvzip",
    "kvzap",
    "knorm",
    "streaming",
    "snapkv",
    "tova",
    "full",
)
QUERY_AWARE: tuple[str, ...] = ("snapkv", "tova")  # read the model's queries to evict
TAPPED: tuple[str, ...] = (*QUERY_AWARE, "kvzip")  # need the layers' query taps
POSITIONED: tuple[str, ...] = ("kvzip",)  # keep each row's true position and token score
KERNEL_MODES: tuple[str, ...] = ("auto", "on", "off")
BUDGET_MODES: tuple[str, ...] = ("per_head", "adaptive", "global")
DEFAULT_METHOD: Method = "qfilters"
# The server's default method, ``--kv-method auto``: where the server evicts a request on its
# own (no method or budget sent, ``--budget auto``, its full cache past the memory), KVzap
# where the model has surrogates, whose needle in prose holds at 2-8x where Q-Filters' falls
# to a fifth (bench/RESULTS.md) at about the same cost; else, and for a request that sends a
# budget, DEFAULT_METHOD (the budget field is ``qfilters_budget``).
AUTO_METHOD = "auto"
PICKED_METHOD: Method = "kvzap"
SERVER_METHODS: tuple[str, ...] = (AUTO_METHOD, *METHODS)
DEFAULT_BUDGET = 512
DEFAULT_N_SINK = 4
DEFAULT_RECENT = 0
DEFAULT_CALIB_TOKENS = 128
DEFAULT_CHUNK = 1  # a CacheConfig's own: rows ranked one by one
SERVED_CHUNK = 8  # what the server gives scored methods by default (see fit_chunk)
SCORED: tuple[str, ...] = ("qfilters", "knorm")  # rank rows by a score: chunks apply
CHUNKED_MIN_BUDGET = 256  # the smallest budget the default chunk was measured at
DEFAULT_BUDGET_MODE: BudgetMode = "per_head"
DEFAULT_FLOOR = 0.2  # AdaKV's default share of the budget every head keeps
# kvzip's rows shared across layers: on SmolLM2's needle documents per-head kvzip lost the
# needle at 2x where the shared rows kept it (README, bench/results/smollm2/kvzip).
# Methods whose scores rank rows across layers, so they may share them (``global``), and do
# by default: a fact stated once is read by few heads of few layers, which per-head budgets
# cannot give it (the needle in prose, bench/RESULTS.md: kvzip 0.45 -> 0.85 at 2x, kvzap
# 0.40 -> 0.93).
SHARES_ROWS: tuple[str, ...] = ("kvzip", "kvzap")
DEFAULT_SHARED_BUDGET_MODE: BudgetMode = "global"
# A budget given no recent window: the seed documents measured a 16x perplexity swing in
# generation between recent = 0 and recent = budget/4, so the default window is budget/4.
RECENT_SHARE = 4
MAX_ROWS = 2**31 - 1
AUTO_TEMPLATE_BUDGET = 1 << 20  # an auto budget's stand-in until the worker resolves it
BudgetSource = Literal["auto", "request", "server"]


def fit_chunk(chunk: int | None, method: str, budget: int) -> int:
    """The chunk of a request that sends none, for its own method and budget.

    Chunks are for methods that rank rows by a score (streaming keeps the latest rows
    whatever the chunk; query-aware methods select rows one by one), and a budget must
    exceed its chunk; elsewhere 1. ``chunk`` is the server's ``--chunk``; ``None`` (not given)
    means :data:`SERVED_CHUNK` at budgets of at least :data:`CHUNKED_MIN_BUDGET`. Chunks of 8
    won or tied on SmolLM2 at budgets 256-1,024 (README); at budget 64 the bundled tiny
    model's pass-key answer broke with them (8 chunks leave few to choose among), so smaller
    budgets read token by token unless the server or the request asks for chunks.
    """
    if method not in SCORED:
        return 1
    if chunk is None:
        return SERVED_CHUNK if budget >= CHUNKED_MIN_BUDGET else 1
    return chunk if chunk < budget else 1


def fit_budget_mode(mode: str, method: str, threshold: bool = False) -> BudgetMode:
    """The budget mode of a request that sends none, for its own method: the server's
    ``mode``, except that :data:`SHARES_ROWS` take :data:`DEFAULT_SHARED_BUDGET_MODE` where
    that is the general default (``per_head``) and no ``threshold`` bounds them (a threshold
    is per head), and other methods ``per_head`` where it is ``global``."""
    if method in SHARES_ROWS and mode == DEFAULT_BUDGET_MODE and not threshold:
        return DEFAULT_SHARED_BUDGET_MODE
    if method not in SHARES_ROWS and mode == "global":
        return DEFAULT_BUDGET_MODE
    if mode not in BUDGET_MODES:
        raise ConfigError("budget_mode", f"budget_mode must be one of {BUDGET_MODES}, got {mode!r}")
    return cast(BudgetMode, mode)


class ConfigError(ValueError):
    """An invalid eviction setting; ``param`` names the :class:`CacheConfig` field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class CacheConfig:
    """How one request's KV caches evict.

    Args:
        method: ``qfilters`` (projection on a per-head filter), ``kvzip`` (the attention a
            reconstruction of the context pays each key, :mod:`qfserve.engine.kv.kvzip`),
            ``kvzap`` (that attention as a learned surrogate predicts it from the key's hidden
            state, :mod:`qfserve.engine.kv.kvzap`), ``knorm``
            (keep small-norm keys), ``streaming`` (sinks + most recent rows), ``snapkv`` / ``tova`` (query-aware
            references, :mod:`qfserve.engine.kv.query_aware`) or ``full`` (no eviction).
        budget: Rows kept per layer and KV head, sinks and recent rows included.
        n_sink: Leading positions never evicted. Default: ``4``.
        recent: Trailing positions never evicted. Default: ``0`` (paper-faithful);
            about ``budget // 4`` helps open-ended generation.
        sign: ``+1`` keeps keys with a large projection on the filter, ``-1`` the opposite
            (an ablation; meaningful on the key-SVD fallback, whose sign is ambiguous).
        calib_tokens: Keys observed before the key-SVD fallback freezes its direction.
        chunk: Block evictions keep whole chunks of this many positions, ranked by their
            mean score (ChunkKV); ``1`` (default) ranks rows one by one.
        budget_mode: ``per_head`` (default): ``budget`` rows in every KV head;
            ``adaptive``: block evictions share ``budget * n_kv_heads`` rows across a
            layer's heads (AdaKV), each keeping at least ``floor`` of its budget;
            ``global`` (kvzip and kvzap): ``budget * n_kv_heads * n_layers`` rows shared
            across every layer and head by the reconstruction pass's scores (kvpress's
            KVzip default) or the surrogates' (KVzap's threshold over every layer).
        floor: Share of ``budget`` every head keeps under ``adaptive`` (``0 < floor <= 1``).
        kernel: Fused eviction kernel: ``auto`` (where a GPU backend exists), ``on``
            (require it) or ``off`` (pure MLX).
        positions: Keep each row's true position whatever the method, so the request can
            say which prompt tokens its caches still hold when it ends (``kv_cache_detail``).
            The rows kept are the same; it costs a position and a score per row.
        threshold: ``kvzap`` only: also evict rows outside the sinks and the recent window
            whose predicted log KVzip+ score is below it, ``budget`` still the cap
            (:class:`qfserve.engine.kv.cache.EvictionCache`); ``None``: the budget alone.
    """

    method: Method = DEFAULT_METHOD
    budget: int = DEFAULT_BUDGET
    n_sink: int = DEFAULT_N_SINK
    recent: int = DEFAULT_RECENT
    sign: int = 1
    calib_tokens: int = DEFAULT_CALIB_TOKENS
    chunk: int = DEFAULT_CHUNK
    budget_mode: BudgetMode = DEFAULT_BUDGET_MODE
    floor: float = DEFAULT_FLOOR
    kernel: KernelMode = "auto"
    positions: bool = False
    threshold: float | None = None

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ConfigError("method", f"method must be one of {METHODS}, got {self.method!r}")
        if self.kernel not in KERNEL_MODES:
            raise ConfigError(
                "kernel", f"kernel must be one of {KERNEL_MODES}, got {self.kernel!r}"
            )
        for name in ("budget", "n_sink", "recent", "calib_tokens", "chunk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(name, f"{name} must be an integer, got {value!r}")
        if self.budget < 1:
            raise ConfigError("budget", f"budget must be >= 1, got {self.budget}")
        for name in ("budget", "n_sink", "recent", "chunk"):
            if getattr(self, name) > MAX_ROWS:  # row counts travel as int32 on the device
                raise ConfigError(name, f"{name} must be <= {MAX_ROWS}, got {getattr(self, name)}")
        if self.n_sink < 0:
            raise ConfigError("n_sink", f"n_sink must be >= 0, got {self.n_sink}")
        if self.recent < 0:
            raise ConfigError("recent", f"recent must be >= 0, got {self.recent}")
        if self.calib_tokens < 1:
            raise ConfigError("calib_tokens", f"calib_tokens must be >= 1, got {self.calib_tokens}")
        if self.chunk < 1:
            raise ConfigError("chunk", f"chunk must be >= 1, got {self.chunk}")
        if self.method != "full" and self.chunk >= self.budget:
            raise ConfigError("chunk", f"chunk must be < budget={self.budget}, got {self.chunk}")
        if self.budget_mode not in BUDGET_MODES:
            raise ConfigError(
                "budget_mode",
                f"budget_mode must be one of {BUDGET_MODES}, got {self.budget_mode!r}",
            )
        if self.budget_mode == "global" and self.method not in (*SHARES_ROWS, "full"):
            raise ConfigError(
                "budget_mode",
                "budget_mode='global' shares rows across layers by scores comparable across "
                f"them (kvzip's pass, kvzap's surrogates): method must be one of "
                f"{SHARES_ROWS}, got {self.method!r}",
            )
        if self.method in TAPPED and self.chunk != 1:
            raise ConfigError("chunk", f"{self.method} selects rows one by one: chunk must be 1")
        if self.method in QUERY_AWARE and self.budget_mode != "per_head":
            raise ConfigError(
                "budget_mode", f"{self.method} keeps budget rows per head: budget_mode per_head"
            )
        if isinstance(self.floor, bool) or not isinstance(self.floor, (int, float)):
            raise ConfigError("floor", f"floor must be a number, got {self.floor!r}")
        if not 0 < self.floor <= 1:
            raise ConfigError("floor", f"floor must be in (0, 1], got {self.floor}")
        if not isinstance(self.positions, bool):
            raise ConfigError("positions", f"positions must be a boolean, got {self.positions!r}")
        if self.positions and not self.evicts:
            raise ConfigError(
                "positions", "method 'full' keeps every row: there is nothing to report kept"
            )
        if self.threshold is not None:
            self._check_threshold()
        if self.sign not in (1, -1) or isinstance(self.sign, bool):
            raise ConfigError("sign", f"sign must be +1 or -1, got {self.sign!r}")
        if self.method != "full" and self.n_sink + self.recent >= self.budget:
            raise ConfigError(
                "budget",
                "n_sink + recent must be < budget (some rows must be evictable): "
                f"got n_sink={self.n_sink} + recent={self.recent} >= budget={self.budget}",
            )

    def _check_threshold(self) -> None:
        value = self.threshold
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(value)
        ):
            raise ConfigError("threshold", f"threshold must be a finite number, got {value!r}")
        if self.method != "kvzap":
            raise ConfigError(
                "threshold",
                f"a threshold bounds kvzap's predicted scores: method must be kvzap, got "
                f"{self.method!r}",
            )
        if self.budget_mode != "per_head":
            raise ConfigError("threshold", "a threshold needs budget_mode per_head")

    @property
    def floor_rows(self) -> int:
        """Rows every head keeps under adaptive budgets: ``floor * budget``, at least the
        protected rows (under ``global``: the protected rows alone)."""
        if self.budget_mode == "global":
            return self.n_sink + self.recent
        return min(self.budget, max(self.n_sink + self.recent, math.ceil(self.floor * self.budget)))

    @property
    def keeps_positions(self) -> bool:
        """The caches keep each row's true position and per-token score beside its rank
        (chunks rank by them; a pass maps rows to the context by them; a request asked what
        was kept)."""
        return self.evicts and (self.chunk > 1 or self.method in POSITIONED or self.positions)

    @property
    def evicts(self) -> bool:
        """False for the ``full`` control arm."""
        return self.method != "full"


def default_recent(budget: int, n_sink: int) -> int:
    """The recent window of a budget that was given none: a quarter of it, leaving some
    rows evictable beside the sinks."""
    return max(0, min(budget // RECENT_SHARE, budget - n_sink - 1))


@dataclass(frozen=True)
class AutoSettings:
    """A request whose budget follows memory, resolved by the worker once its prompt is
    encoded and the model known (:func:`qfserve.engine.serving.admission.resolve_auto`);
    ``method``: the server picks its method too (``--kv-method auto``; the template holds
    :data:`DEFAULT_METHOD` until then). ``recent``, ``chunk`` and ``budget_mode`` are what
    the request sent (``None``: fitted to the method and budget chosen)."""

    recent: int | None = None
    chunk: int | None = None
    budget_mode: BudgetMode | None = None
    method: bool = False
