"""What the server reports about its requests: one record per request, totals and the MLX
memory probe. Counts only, never prompt text or token ids.

The worker thread writes records; the event loop reads :meth:`Ledger.snapshot` for the admin
endpoint and the metrics. Everything shared goes through the ledger's lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.stats import summarize

if TYPE_CHECKING:
    from qfserve.engine.serving.jobs import Job

State = Literal["queued", "prefill", "decode", "done", "cancelled", "error"]
_COUNTED = ("prompt_tokens", "completion_tokens", "kept_bytes", "full_seq_bytes")
_FROM_STATS = (
    "filter_source",
    "tokens_seen",
    "tokens_kept",
    "kept_bytes",
    "full_seq_bytes",
    "compression_ratio",
    "evictions",
    "evicting_layers",
    "window_layers",
    "window_bytes",
)


def mlx_memory() -> dict[str, int]:
    """MLX allocator figures in bytes: held by arrays now, the peak since start, and freed
    buffers kept for reuse; and the process's resident memory. Counter reads only (safe off
    the worker thread)."""
    import mlx.core as mx

    from qfserve.engine.models.memory import resident_bytes

    return {
        "resident_bytes": resident_bytes(),
        "mlx_active_bytes": int(mx.get_active_memory()),
        "mlx_peak_bytes": int(mx.get_peak_memory()),
        "mlx_cache_bytes": int(mx.get_cache_memory()),
    }


@dataclass
class RequestRecord:
    """Counts about one request for the admin endpoint; written by the worker thread only."""

    id: str
    model: str
    kind: str
    method: str
    budget: int
    recent: int
    n_sink: int
    chunk: int = 1
    budget_mode: str = "per_head"
    state: State = "queued"
    filter_source: str = "none"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    tokens_seen: int = 0
    tokens_kept: int = 0
    kept_bytes: int = 0
    kv_reserved_bytes: int = 0
    full_seq_bytes: int = 0
    compression_ratio: float = 1.0
    evictions: int = 0
    evicting_layers: int = 0
    window_layers: int = 0
    window_bytes: int = 0
    created: float = field(default_factory=time.time)
    finished: float | None = None
    error: str | None = None  # why it failed or was cancelled

    @classmethod
    def opened(cls, id: str, model: str, kind: str, method: str) -> RequestRecord:
        """The record of a request just submitted with ``method``; its settings are recorded
        once admission resolves them (:meth:`configure`)."""
        return cls(id=id, model=model, kind=kind, method=method, budget=0, recent=0, n_sink=0)

    def configure(self, config: CacheConfig) -> None:
        """Record the cache settings the request runs with (an ``auto`` budget resolved)."""
        self.method, self.budget, self.recent = config.method, config.budget, config.recent
        self.n_sink, self.chunk, self.budget_mode = config.n_sink, config.chunk, config.budget_mode

    def update(self, caches: list[Any]) -> None:
        """Refresh the cache figures from the request's caches."""
        stats = summarize(caches)
        for name in _FROM_STATS:
            setattr(self, name, getattr(stats, name))

    def kv_cache(self, config: CacheConfig, budget_source: str = "server") -> dict[str, Any]:
        """The ``kv_cache`` summary a finished request reports: its settings, where its
        budget came from, and its figures."""
        return {
            "method": config.method,
            "budget": config.budget,
            "budget_source": budget_source,
            "recent": config.recent,
            "n_sink": config.n_sink,
            "chunk": config.chunk,
            "budget_mode": config.budget_mode,
            "floor": config.floor if config.budget_mode == "adaptive" else None,
            "threshold": config.threshold,
            "filter_source": self.filter_source,
            "tokens_seen": self.tokens_seen,
            "tokens_kept": self.tokens_kept,
            "kept_bytes": self.kept_bytes,
            "full_seq_bytes": self.full_seq_bytes,
            "compression_ratio": self.compression_ratio,
            "evictions": self.evictions,
            "evicting_layers": self.evicting_layers,
            "window_layers": self.window_layers,
            "window_bytes": self.window_bytes,
        }


class Ledger:
    """The one list of live requests (queued, waiting for memory or in the batch), a bounded
    history of finished ones and totals.

    Args:
        history: Finished records kept.
    """

    def __init__(self, history: int) -> None:
        self.weights_bytes = 0  # the served model's weights as held (set by serving())
        # What decode steps' products round activations to (--decode-activations as in
        # effect); None where no native kernel multiplies (a GPU: MLX's own kernels).
        self.decode_activations: str | None = None
        self._lock = threading.Lock()
        self._active: dict[str, Job] = {}
        self._history: deque[RequestRecord] = deque(maxlen=history)
        self._totals = dict.fromkeys(("requests", "done", "cancelled", "error", *_COUNTED), 0)

    def open(self, job: Job) -> None:
        with self._lock:
            self._active[job.id] = job
            self._totals["requests"] += 1

    def discard(self, job: Job) -> None:
        """Undo :meth:`open` for a request that was never queued."""
        with self._lock:
            if self._active.pop(job.id, None) is not None:
                self._totals["requests"] -= 1

    def live(self) -> list[Job]:
        """The requests not finished yet, oldest first (read off-thread to cancel them)."""
        with self._lock:
            return list(self._active.values())

    def close(self, record: RequestRecord, state: State) -> None:
        """The request ended in ``state``: into the history and the totals."""
        record.state, record.finished = state, time.time()
        with self._lock:
            self._active.pop(record.id, None)
            self._history.append(record)
            self._totals[state] += 1
            for name in _COUNTED:
                self._totals[name] += getattr(record, name)

    def idle(self) -> bool:
        with self._lock:
            return not self._active

    def active_kv_bytes(self) -> tuple[int, int]:
        """(kept, full-cache) bytes over the active requests."""
        with self._lock:
            records = [job.record for job in self._active.values()]
        return sum(r.kept_bytes for r in records), sum(r.full_seq_bytes for r in records)

    def serving(self, loaded: Any) -> None:
        """The loaded model's weights' bytes as held (after any split over ranks), and the
        activations its decode products take."""
        from qfserve.engine.models.quantized import decode_activations, weight_bytes

        self.weights_bytes = weight_bytes(loaded.model)
        self.decode_activations = decode_activations(loaded.model)

    def find(self, id: str) -> dict[str, Any] | None:
        """One request's record (live or in the history), as a plain dict."""
        with self._lock:
            job = self._active.get(id)
            if job is not None:
                return asdict(job.record)
            done = next((r for r in self._history if r.id == id), None)
            return None if done is None else asdict(done)

    def snapshot(self) -> dict[str, Any]:
        """Active and recent records plus totals (with MLX memory), as plain dicts."""
        with self._lock:
            active = [asdict(job.record) for job in self._active.values()]
            history = [asdict(r) for r in reversed(self._history)]
            totals: dict[str, Any] = dict(self._totals)
        totals["active"] = len(active)
        totals["queued"] = sum(r["state"] == "queued" for r in active)
        totals["batch"] = sum(r["state"] in ("prefill", "decode") for r in active)
        totals["kv_used_bytes"] = sum(r["kept_bytes"] for r in active)
        totals["weights_bytes"] = self.weights_bytes
        totals["decode_activations"] = self.decode_activations
        totals.update(mlx_memory())
        return {"active": active, "history": history, "totals": totals}
