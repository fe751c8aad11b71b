"""``qfserve``: serve a model over the OpenAI API; ``qfserve calibrate ...`` calibrates filters.

OpenBLAS is preloaded (a re-exec) before MLX is imported, and the BLAS in use is logged.
SIGTERM stops taking new requests (503) and lets in-flight ones finish for up to
``--drain-timeout`` seconds.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from engine.blas import blas_summary, reexec_with_openblas
from engine.config import DEFAULT_BUDGET, DEFAULT_METHOD, DEFAULT_N_SINK, DEFAULT_RECENT, METHODS

logger = logging.getLogger("qfserve")


def make_parser() -> argparse.ArgumentParser:
    from server import settings as s

    p = argparse.ArgumentParser(
        prog="qfserve",
        description="OpenAI-compatible MLX server with Q-Filters KV eviction. "
        "'qfserve calibrate --help' for filter calibration.",
    )
    p.add_argument(
        "--model",
        default=None,
        help="local folder or Hugging Face id (default: the bundled models/qfserve-tiny)",
    )
    p.add_argument("--host", default=s.DEFAULT_HOST, help="bind address (default: %(default)s)")
    p.add_argument("--port", type=int, default=s.DEFAULT_PORT, help="(default: %(default)s)")
    p.add_argument(
        "--kv-method",
        choices=METHODS,
        default=DEFAULT_METHOD,
        help="default eviction method (default: %(default)s)",
    )
    p.add_argument(
        "--budget",
        type=int,
        default=DEFAULT_BUDGET,
        help="default KV rows kept per layer and head (default: %(default)s)",
    )
    p.add_argument(
        "--recent",
        type=int,
        default=DEFAULT_RECENT,
        help="default recent positions never evicted (default: %(default)s)",
    )
    p.add_argument(
        "--n-sink",
        type=int,
        default=DEFAULT_N_SINK,
        help="default leading positions never evicted (default: %(default)s)",
    )
    p.add_argument(
        "--max-queue",
        type=int,
        default=s.DEFAULT_MAX_QUEUE,
        help="requests waiting at most before 503 (default: %(default)s)",
    )
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health",
    )
    p.add_argument("--admin-key", default=None, help="key for /admin/cache (default: --api-key)")
    p.add_argument("--no-admin", action="store_true", help="remove the /admin/cache endpoint")
    p.add_argument(
        "--max-body-bytes",
        type=int,
        default=s.DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413 (default: %(default)s)",
    )
    p.add_argument(
        "--drain-timeout",
        type=float,
        default=s.DEFAULT_DRAIN_TIMEOUT,
        help="seconds in-flight requests may finish after SIGTERM (default: %(default)s)",
    )
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    return p


def settings_from_args(args: argparse.Namespace):
    from server.settings import Settings

    return Settings(
        model=args.model,
        host=args.host,
        port=args.port,
        kv_method=args.kv_method,
        budget=args.budget,
        recent=args.recent,
        n_sink=args.n_sink,
        max_queue=args.max_queue,
        api_key=args.api_key,
        admin_key=args.admin_key,
        admin_enabled=not args.no_admin,
        max_body_bytes=args.max_body_bytes,
        drain_timeout=args.drain_timeout,
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``qfserve`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    reexec_with_openblas()  # must precede any MLX import
    if argv and argv[0] == "calibrate":
        from calibrations.cli import main as calibrate

        return calibrate(argv[1:]) or 0
    parser = make_parser()
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logger.info(blas_summary())

    from engine.loading import ModelNotFoundError, resolve_model_ref

    try:
        logger.info("model: %s", resolve_model_ref(settings.model))
    except ModelNotFoundError as exc:
        print(f"qfserve: error: {exc}", file=sys.stderr)
        return 2
    _serve(settings, args.log_level)
    return 0


def _serve(settings, log_level: str) -> None:
    import uvicorn

    from server.app import build_app

    app = build_app(settings)
    worker = app.state.worker

    class DrainingServer(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:  # type: ignore[override]
            worker.drain()  # new requests get 503 while in-flight ones finish
            super().handle_exit(sig, frame)

    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        timeout_graceful_shutdown=int(settings.drain_timeout) + 1,
    )
    DrainingServer(config).run()


if __name__ == "__main__":
    sys.exit(main())
