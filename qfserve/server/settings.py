"""Server settings: read once from the command line (defaults from ``QFSERVE_*`` environment
variables), frozen, replaced wholesale in tests."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic_settings import BaseSettings, SettingsConfigDict

from qfserve.engine.filters.model import DEFAULT_SELF_CALIBRATION, SelfCalibration
from qfserve.engine.kv.config import (
    DEFAULT_BUDGET,
    DEFAULT_BUDGET_MODE,
    DEFAULT_FLOOR,
    DEFAULT_METHOD,
    DEFAULT_N_SINK,
    DEFAULT_RECENT,
    BudgetMode,
    CacheConfig,
    Method,
    fit_budget_mode,
    fit_chunk,
)
from qfserve.engine.serving.worker import (
    DEFAULT_HISTORY,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_QUEUE,
    DEFAULT_PREFILL_CHUNK,
    DEFAULT_PROMPT_CACHE_SIZE,
)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
DEFAULT_DRAIN_TIMEOUT = 30.0
DEFAULT_WRITE_TIMEOUT = 15.0


class EnvDefaults(BaseSettings):
    """Every flag's default, overridable as ``QFSERVE_<FLAG>`` (``QFSERVE_PORT=8080``)."""

    model_config = SettingsConfigDict(env_prefix="QFSERVE_", extra="ignore")

    model: str | None = None
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    kv_method: str = DEFAULT_METHOD
    budget: int = DEFAULT_BUDGET
    recent: int = DEFAULT_RECENT
    n_sink: int = DEFAULT_N_SINK
    chunk: int | None = None
    budget_mode: str = DEFAULT_BUDGET_MODE
    floor: float = DEFAULT_FLOOR
    max_queue: int = DEFAULT_MAX_QUEUE
    max_batch: int = DEFAULT_MAX_BATCH
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    max_kv_bytes: int | None = None
    prompt_cache_size: int = DEFAULT_PROMPT_CACHE_SIZE
    prompt_cache_bytes: int | None = None
    prompt_cache_dir: str | None = None
    self_calibration: SelfCalibration = DEFAULT_SELF_CALIBRATION
    api_key: str | None = None
    api_key_file: str | None = None
    admin_key: str | None = None
    no_admin: bool = False
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    write_timeout: float = DEFAULT_WRITE_TIMEOUT
    log_level: str = "info"


@dataclass(frozen=True)
class Settings:
    """Everything the app needs; defaults match the ``qfserve`` flags.

    Args:
        model: What ``--model`` names (see :func:`qfserve.engine.models.loading.resolve_model_ref`);
            ``None`` serves the default catalog model.
        kv_method, budget, recent, n_sink, chunk, budget_mode, floor: Eviction defaults
            for requests that do not send ``kv_method`` / ``qfilters_*``. A request that
            sends no chunk gets :func:`qfserve.engine.kv.config.fit_chunk` of ``chunk`` for its own
            method and budget (``None``: the served default, 8 at budgets of 256 or more).
        max_queue: Requests waiting for the worker at most (then 503 + Retry-After).
        max_batch: Requests generating at once in one batch (1: one at a time).
        prefill_chunk: Prompt tokens per prefill step; bounds how long a newcomer's prefill
            holds up the streams already running.
        max_kv_bytes: KV bytes the running requests' caches may hold together (``None``: a
            quarter of physical memory); a request that can never fit gets a 400.
        prompt_cache_size: Finished requests' caches kept for later turns (0: no reuse).
        prompt_cache_bytes: Bytes those may hold (``None``: up to ``max_kv_bytes``).
        prompt_cache_dir: Keep those on disk and start with the ones saved there.
        self_calibration: What a model without a calibration artifact does: ``traffic``
            learns one from the queries of served prompts (the key-SVD fallback until then),
            ``prompt`` also gives each request its own prompt's filters until then, ``off``
            neither.
        api_key: When set, every route but ``/health`` needs ``Authorization: Bearer <key>``.
        admin_key: When set, the admin endpoint needs it instead of ``api_key``.
        admin_enabled: ``False`` removes the admin endpoint.
        max_body_bytes: Larger request bodies get 413.
        drain_timeout: Seconds in-flight streams may take to finish after SIGTERM.
        write_timeout: A stream whose client has not taken a chunk for this long is aborted
            (its generation cancelled, its cache freed).
        history: Finished requests the admin endpoint remembers.
    """

    model: str | None = None
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    kv_method: Method = DEFAULT_METHOD
    budget: int = DEFAULT_BUDGET
    recent: int = DEFAULT_RECENT
    n_sink: int = DEFAULT_N_SINK
    chunk: int | None = None
    budget_mode: BudgetMode = DEFAULT_BUDGET_MODE
    floor: float = DEFAULT_FLOOR
    max_queue: int = DEFAULT_MAX_QUEUE
    max_batch: int = DEFAULT_MAX_BATCH
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK
    max_kv_bytes: int | None = None
    prompt_cache_size: int = DEFAULT_PROMPT_CACHE_SIZE
    prompt_cache_bytes: int | None = None
    prompt_cache_dir: str | None = None
    self_calibration: SelfCalibration = DEFAULT_SELF_CALIBRATION
    api_key: str | None = None
    admin_key: str | None = None
    admin_enabled: bool = True
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    drain_timeout: float = DEFAULT_DRAIN_TIMEOUT
    write_timeout: float = DEFAULT_WRITE_TIMEOUT
    history: int = DEFAULT_HISTORY

    def __post_init__(self) -> None:
        # Built once: a bad eviction flag raises qfserve.engine.kv.config.ConfigError (a ValueError).
        defaults = CacheConfig(
            method=self.kv_method,
            budget=self.budget,
            recent=self.recent,
            n_sink=self.n_sink,
            chunk=fit_chunk(None, self.kv_method, self.budget)
            if self.chunk is None
            else self.chunk,
            budget_mode=fit_budget_mode(self.budget_mode, self.kv_method),
            floor=self.floor,
        )
        object.__setattr__(self, "_cache_defaults", defaults)
        for name in ("max_queue", "max_batch", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_kv_bytes", "prompt_cache_bytes"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.prompt_cache_size < 0:
            raise ValueError(f"prompt_cache_size must be >= 0, got {self.prompt_cache_size}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")
        if self.drain_timeout < 0:
            raise ValueError(f"drain_timeout must be >= 0, got {self.drain_timeout}")
        if not self.write_timeout > 0:
            raise ValueError(f"write_timeout must be > 0, got {self.write_timeout}")

    def cache_defaults(self) -> CacheConfig:
        """The eviction settings a request gets when it sends none (built at construction)."""
        return self._cache_defaults  # type: ignore[attr-defined, no-any-return]
