"""The command line every study shares: ``--model``, ``--quick``, ``--out``, ``--seed``, and
where a study needs them ``--reps`` (timed repetitions) and ``--calibration`` (which filters).

``--model`` defaults to the model ``qfserve`` serves (SmolLM2-135M-Instruct); ``--quick``
alone defaults to the bundled ``qfserve-tiny``, so a smoke run needs nothing downloaded.
Results go to ``bench/results/<model>/`` unless ``--out`` says otherwise.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from bench.models import BUNDLED, DEFAULT_MODEL, results_dir


def parser(
    description: str, *, reps: int | None = None, calibration: bool = False
) -> argparse.ArgumentParser:
    """The shared arguments; ``reps`` adds ``--reps`` with that default, ``calibration`` adds
    ``--calibration``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--model",
        default=None,
        help=f"catalog name, GGUF file, mlx-lm folder or hub id (default: {DEFAULT_MODEL}; "
        f"with --quick: {BUNDLED})",
    )
    p.add_argument("--quick", action="store_true", help="CI-sized smoke run (seconds)")
    p.add_argument(
        "--out", type=Path, default=None, help="results folder (default: bench/results/<model>)"
    )
    p.add_argument("--seed", type=int, default=0)
    if reps is not None:
        p.add_argument(
            "--reps",
            type=int,
            default=None,
            help=f"timed repetitions per arm (default: {reps}; quick: 2)",
        )
        p.set_defaults(default_reps=reps)
    if calibration:
        p.add_argument(
            "--calibration",
            choices=("auto", "registry", "fresh"),
            default="auto",
            help="calibrated filters: the registry's artifact if one exists (auto), only the "
            "registry, or always calibrate afresh on held-in training text",
        )
    return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse and fill the defaults that depend on other arguments (model, out, reps)."""
    args = p.parse_args(argv)
    if args.model is None:
        args.model = BUNDLED if args.quick else DEFAULT_MODEL
    if args.out is None:
        args.out = results_dir(args.model)
    if hasattr(args, "reps"):
        if args.reps is None:
            args.reps = 2 if args.quick else args.default_reps
        if args.reps < 1:
            p.error(f"--reps must be >= 1, got {args.reps}")
    return args


def command_line(module: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces this run: ``python -m <module> <arguments>``."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python -m", module, *args])
