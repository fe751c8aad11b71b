"""Shared pieces of the reliability suite: the two sizes, a real server on 127.0.0.1, probes
of its memory and state, SSE reading, percentiles and the figures report.

Every loop here is bounded in count and in time; nothing talks to any address but loopback.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from qfserve import testing
from qfserve.testing import HOST, REPO

BUNDLED = REPO / "models" / "qfserve-tiny"
RESULTS = REPO / "bench" / "results" / "reliability.json"
ENV_SIZE = "QFSERVE_RELIABILITY"  # "full" runs the full sizes (python -m tests.reliability --full)


@dataclass(frozen=True)
class Size:
    """How big each part runs; ``CI`` fits the normal test run, ``FULL`` is the issue's."""

    name: str
    steady_requests: int
    steady_clients: int
    steady_max_tokens: tuple[int, int]
    overload_clients: int
    overload_queue: int
    storm_requests: int
    storm_concurrency: int
    fuzz_examples: int  # schemathesis --max-examples per operation
    fuzz_min_cases: int
    slowloris_sockets: int
    stall_s: float
    write_timeout: float
    shutdown_streams: int
    drain_timeout: float
    model_files: int  # mutated GGUF files start-up is given (tests/reliability/model_fuzz.py)


CI = Size(
    name="ci",
    steady_requests=48,
    steady_clients=32,
    steady_max_tokens=(4, 16),
    overload_clients=128,
    overload_queue=16,
    storm_requests=64,
    storm_concurrency=16,
    fuzz_examples=10,
    fuzz_min_cases=150,
    slowloris_sockets=50,
    stall_s=10.0,
    write_timeout=3.0,
    shutdown_streams=16,
    drain_timeout=4.0,
    model_files=400,
)
FULL = Size(
    name="full",
    steady_requests=256,
    steady_clients=32,
    steady_max_tokens=(8, 64),
    overload_clients=128,
    overload_queue=16,
    storm_requests=320,
    storm_concurrency=32,
    fuzz_examples=300,
    fuzz_min_cases=1000,
    slowloris_sockets=50,
    stall_s=30.0,
    write_timeout=15.0,
    shutdown_streams=16,
    drain_timeout=10.0,
    model_files=5000,
)


def current_size() -> Size:
    return FULL if os.environ.get(ENV_SIZE) == "full" else CI


# -- figures -------------------------------------------------------------------------------


class Report:
    """Figures per part; written as JSON at the end of a full run."""

    def __init__(self, size: Size) -> None:
        self.size = size
        self.parts: dict[str, dict[str, Any]] = {}

    def add(self, part: str, figures: dict[str, Any]) -> None:
        self.parts[part] = figures
        print(f"\n[reliability:{self.size.name}] {part}: {json.dumps(figures, default=str)}")

    def write(self, path: Path) -> None:
        """Write the figures; parts run earlier at the same size (``-k`` reruns) are kept."""
        parts = {}
        if path.exists():
            old = json.loads(path.read_text())
            parts = old.get("parts", {}) if old.get("size") == self.size.name else {}
        self.parts = {**parts, **self.parts}
        doc = {
            "size": self.size.name,
            "sizes": asdict(self.size),
            "machine": {"cpus": os.cpu_count(), "platform": sys.platform},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "parts": self.parts,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1, default=str) + "\n")


def percentiles(values: Sequence[float], qs: Sequence[int] = (50, 99)) -> dict[str, float]:
    """Nearest-rank percentiles in milliseconds (``p50``, ``p99``); empty input gives ``{}``."""
    if not values:
        return {}
    ordered = sorted(values)
    out = {}
    for q in qs:
        rank = max(1, min(len(ordered), -(-q * len(ordered) // 100)))
        out[f"p{q}_ms"] = round(ordered[rank - 1] * 1000, 2)
    return out


# -- the model -----------------------------------------------------------------------------


def bundled_model(scratch: Path) -> Path:
    """``models/qfserve-tiny`` when it is there, else a tiny random model saved in its place."""
    if (BUNDLED / "config.json").exists() and any(BUNDLED.glob("*.safetensors")):
        return BUNDLED
    from tests.tiny import save_tiny_model

    return save_tiny_model(scratch / "qfserve-tiny")


def eos_ids(model: Path) -> list[int]:
    """Every token id that ends generation: biasing them away makes token counts exact."""
    from tokenizers import Tokenizer

    config = json.loads((model / "config.json").read_text())
    ids = config.get("eos_token_id") or []
    ids = set(ids if isinstance(ids, list) else [ids])
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        f = model / name
        eos = json.loads(f.read_text()).get("eos_token") if f.exists() else None
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if eos and tok.token_to_id(eos) is not None:
            ids.add(tok.token_to_id(eos))
    return sorted(ids)


# -- the server ----------------------------------------------------------------------------


@dataclass
class Server(testing.ServerProcess):
    """A ``python -m qfserve.server.cli`` subprocess on 127.0.0.1 and an ephemeral port, with probes
    of its state and the ``logit_bias`` that keeps its model from ending early."""

    model: Path
    no_bias: dict[str, int] = field(default_factory=dict)

    def admin(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/admin/cache", timeout=10).json()

    def rss(self) -> int:
        return psutil.Process(self.pid).memory_info().rss

    def state(self) -> dict[str, int]:
        """Active and queued requests, KV bytes they hold, RSS and MLX memory, right now."""
        snap = self.admin()
        totals = snap["totals"]
        return {
            "active": totals["active"],
            "queued": totals["queued"],
            "kv_bytes": sum(r["kept_bytes"] for r in snap["active"]),
            "rss_bytes": self.rss(),
            "mlx_active_bytes": totals["mlx_active_bytes"],
            "mlx_peak_bytes": totals["mlx_peak_bytes"],
            "mlx_cache_bytes": totals["mlx_cache_bytes"],
        }

    def wait_idle(self, timeout: float) -> float | None:
        """Seconds until nothing is active, queued or holding KV bytes; ``None`` if never."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            s = self.state()
            if s["active"] == 0 and s["queued"] == 0 and s["kv_bytes"] == 0:
                return time.monotonic() - t0
            time.sleep(0.05)
        return None


def start_server(
    model: Path,
    log: Path,
    *flags: str,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
    wait: bool = True,
) -> Server:
    """Start qfserve at log level warning; with ``wait`` return once ``/health`` is 200
    (raise if it exits). ``env`` is added to this process's environment."""
    base = testing.launch(
        "qfserve", model, *flags, log=log, env={**os.environ, **(env or {})}, log_level="warning"
    )
    server = Server(**vars(base), no_bias={str(t): -100 for t in eos_ids(model)})
    if wait:
        testing.wait_ready(server, timeout)
    return server


def stop_server(server: Server, timeout: float = 30.0) -> int:
    """SIGTERM, wait (kill after ``timeout``); returns the exit status."""
    return server.stop(timeout)


class Sampler:
    """Polls the server's RSS, MLX memory and active KV bytes every ``period`` seconds and
    keeps the peaks (a context manager; stops by itself after ``limit`` seconds)."""

    def __init__(self, server: Server, period: float = 0.25, limit: float = 900.0) -> None:
        self.server, self.period, self.limit = server, period, limit
        self.peak: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set() and time.monotonic() - t0 < self.limit:
            try:
                for k, v in self.server.state().items():
                    self.peak[k] = max(self.peak.get(k, 0), v)
            except (httpx.HTTPError, psutil.Error):
                pass
            self._stop.wait(self.period)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


# -- SSE over a raw socket -------------------------------------------------------------------


def http_request(path: str, body: bytes, *, port: int, content_type: str = "application/json"):
    """An HTTP/1.1 POST as bytes."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {HOST}:{port}\r\nContent-Type: {content_type}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


def sse_events(lines: Iterator[str]) -> Iterator[str]:
    """The ``data:`` payloads of an SSE line iterator."""
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: ") :]
