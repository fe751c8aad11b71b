"""Prometheus metrics, in a registry per app so several apps (tests) never collide."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from qfserve.engine.serving.records import mlx_memory
from qfserve.engine.serving.worker import Worker

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def _total(worker: Worker, key: str) -> Callable[[], float]:
    return lambda: float(worker.snapshot()["totals"][key])


def _mlx_bytes(key: str) -> Callable[[], float]:
    """Reads one of :func:`mlx_memory`'s figures (``key`` bound now, not when called)."""
    return lambda: mlx_memory()[f"mlx_{key}_bytes"]


class Metrics:
    """Request outcomes, token counts, TTFT / latency, queue and KV-cache memory."""

    def __init__(self, worker: Worker) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "qfserve_requests",
            "Generation requests by endpoint and outcome",
            ["endpoint", "outcome"],
            registry=r,
        )
        # Every answer by status, rejections included (a 400 from validation, a 413 from the
        # body limit, a 401): ``requests`` counts only the generations that were started.
        self.responses = Counter(
            "qfserve_http_responses", "HTTP responses by status code", ["status"], registry=r
        )
        self.prompt_tokens = Counter("qfserve_prompt_tokens", "Prompt tokens processed", registry=r)
        self.completion_tokens = Counter(
            "qfserve_completion_tokens", "Tokens generated", registry=r
        )
        self.ttft = Histogram(
            "qfserve_time_to_first_token_seconds",
            "From request arrival to the first generated text",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.latency = Histogram(
            "qfserve_request_latency_seconds",
            "From request arrival to the last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.kv_kept_total = Counter(
            "qfserve_kv_kept_bytes",
            "KV-cache bytes kept at the end of finished requests",
            registry=r,
        )
        self.kv_full_total = Counter(
            "qfserve_kv_full_bytes",
            "KV-cache bytes full caches would have held for them",
            registry=r,
        )
        Gauge("qfserve_active_requests", "Requests queued or generating", registry=r).set_function(
            lambda: worker.snapshot()["totals"]["active"]
        )
        Gauge("qfserve_queue_length", "Requests waiting for the worker", registry=r).set_function(
            worker.queue_length
        )
        Gauge(
            "qfserve_active_kv_kept_bytes", "KV-cache bytes held by active requests", registry=r
        ).set_function(lambda: worker.active_kv_bytes()[0])
        Gauge(
            "qfserve_active_kv_full_bytes",
            "KV-cache bytes full caches would hold for active requests",
            registry=r,
        ).set_function(lambda: worker.active_kv_bytes()[1])
        for key, what in (
            ("batch", "Requests in the running batch (prefilling or decoding)"),
            ("kv_reserved_bytes", "KV bytes the running requests' caches can hold at most"),
            ("max_kv_bytes", "KV bytes the running requests may reserve together"),
            ("weights_bytes", "Bytes of the model's weights as held (codes, scales, floats)"),
            ("resident_bytes", "Resident memory of the server process"),
        ):
            Gauge(f"qfserve_{key}", what, registry=r).set_function(_total(worker, key))
        for key, what in (
            ("active", "held by live arrays"),
            ("peak", "peak held since start"),
            ("cache", "freed but kept for reuse"),
        ):
            Gauge(f"qfserve_mlx_{key}_bytes", f"MLX memory {what}", registry=r).set_function(
                _mlx_bytes(key)
            )
