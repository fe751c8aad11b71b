"""``qfserve``: serve a model over the OpenAI API; ``qfserve calibrate ...`` calibrates filters.

OpenBLAS is preloaded (a re-exec) before MLX is imported, and the BLAS in use is logged.
SIGTERM (or Ctrl-C) starts a drain: the socket stays open and new requests get 503 while
in-flight ones finish for up to ``--drain-timeout`` seconds; those still running then end
with an error (a stream: an ``error`` event and ``[DONE]``), and the process exits 0. A
second signal stops at once. A model that is missing, cannot be fetched or cannot be served
(a GGUF file qfserve does not read) exits 2 before the port is bound, and so does one whose
calibration file must not be used (damaged, another model's, the wrong shape), found on the
model thread; each says so in one line naming the file. A model that fails to load otherwise
exits 1. Under ``mlx.launch`` every rank runs the same command: rank 0 serves, the others
follow its steps (:mod:`qfserve.engine.serving.lockstep`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import sys
from collections.abc import Sequence
from typing import Any

from qfserve.engine.models.blas import blas_summary, reexec_with_openblas
from qfserve.server.serve import follow, port_problem, serve
from qfserve.server.settings import EnvDefaults, make_parser, settings_from_args

logger = logging.getLogger("qfserve")


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``qfserve`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    reexec_with_openblas()  # must precede any MLX import
    if argv and argv[0] == "calibrate":
        from qfserve.calibrations.cli import main as calibrate
        from qfserve.engine.models.loading import load_model, resolve_model_ref

        def load(source: str) -> tuple[Any, Any, dict[str, Any]]:
            from qfserve.engine.kv.attention import install_head_masks

            loaded = load_model(source)
            # The served attention path (native prefill attention on the CPU): a 2,048-token
            # block of SmolLM2 reads in ~3.5 s through it, ~24 s through MLX's own.
            with contextlib.suppress(ValueError):  # an attention it cannot wrap: MLX's own
                install_head_masks(loaded.model)
            return loaded.model, loaded.tokenizer, loaded.config

        return calibrate(argv[1:], resolve_model=resolve_model_ref, load=load) or 0
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
    from qfserve.engine.serving.liveness import launched_rank

    # Under mlx.launch every rank runs this command; only rank 0 listens.
    rank = launched_rank()
    problem = None if rank else port_problem(settings.host, settings.port)
    if problem is not None:  # before anything slow: a clash fails in about a second
        print(
            f"qfserve: error: cannot listen on {settings.host}:{settings.port}: {problem}",
            file=sys.stderr,
        )
        return 2
    logging.basicConfig(
        level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logger.info(blas_summary())

    from qfserve.engine.models.catalog import ModelFetchError
    from qfserve.engine.models.gguf import GGUFError
    from qfserve.engine.models.loading import ModelNotFoundError, gguf_alias, resolve_model_ref

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
    alias = settings.alias or gguf_alias(settings.model)
    settings = dataclasses.replace(settings, model=source, alias=alias)
    if rank:
        follow(settings)
    return serve(settings, settings.log_level)


if __name__ == "__main__":
    sys.exit(main())
