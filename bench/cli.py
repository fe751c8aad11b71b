"""The command line every study shares: the model and results folder it defaults to, sizes
that shrink with ``--quick``, and the command that reproduces a run."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"
DEFAULT_MODEL = "smollm2-135m-instruct"  # what `qfserve` serves with no --model
BUNDLED = "qfserve-tiny"
RESULTS_FOLDERS = {DEFAULT_MODEL: "smollm2", BUNDLED: BUNDLED}  # bench/results/<folder>/
MiB = 2**20


def parser(
    doc: str,
    *,
    file: str | None = None,
    reps: int | None = None,
    calibration: bool = False,
    **sized: Any,
) -> argparse.ArgumentParser:
    """The shared arguments, plus ``--reps``/``--calibration`` when asked and the study's mode
    option when ``file`` (the JSON a mode writes) belongs to a study with modes; each
    ``name=(full, quick, help)`` adds ``--name`` defaulting to ``full``, or ``quick`` with
    ``--quick``."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    if file is not None and (study := _owner(file)).modes:  # picked already: accepted here
        modes = [m for m, _ in study.modes]
        p.add_argument(study.option, choices=modes, default=modes[0], help=f"default {modes[0]}")
    p.add_argument(
        "--model",
        default=None,
        help=f"catalog name, GGUF file, mlx-lm folder or "
        f"hub id (default: {DEFAULT_MODEL}; with --quick: {BUNDLED})",
    )
    p.add_argument("--quick", action="store_true", help="CI-sized smoke run (seconds)")
    p.add_argument(
        "--out", type=Path, default=None, help="results folder (default: bench/results/<model>)"
    )
    p.add_argument("--seed", type=int, default=0)
    if reps is not None:
        sized["reps"] = (reps, 2, "timed repetitions per arm")
    if calibration:
        p.add_argument(
            "--calibration",
            choices=("auto", "registry", "fresh"),
            default="auto",
            help="calibrated filters (and --kvzap's surrogates): the registry's artifact if "
            "one exists (auto), only the registry, or always calibrate afresh on held-in "
            "training text",
        )
    for name, spec in sized.items():
        full, quick, *about = spec if isinstance(spec, tuple) else (spec, spec)
        many = isinstance(quick, list)
        if full is not None:
            about.append(f"default {_shown(full)}; quick {_shown(quick)}")
        p.add_argument(
            f"--{name.replace('_', '-')}",
            type=type(quick[0] if many else quick),
            nargs="+" if many else None,
            default=None,
            help="; ".join(about),
        )
    p.set_defaults(sized={k: v if isinstance(v, tuple) else (v, v) for k, v in sized.items()})
    return p


def _owner(file: str) -> Any:
    from bench.studies import owner  # the registry imports this module's users

    return owner(file)


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse and fill the defaults that depend on other arguments (model, out, sizes)."""
    args = p.parse_args(argv)
    args.model = args.model or (BUNDLED if args.quick else DEFAULT_MODEL)
    args.out = args.out or results_dir(args.model)
    for name, (full, quick, *_) in args.sized.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if hasattr(args, "reps") and args.reps < 1:
        p.error(f"--reps must be >= 1, got {args.reps}")
    return args


def command_line(file: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces the run writing ``<file>.json``: ``python -m bench <study>
    <mode> <arguments>``, the mode spelled out where ``argv`` left it to its default."""
    study, args = _owner(file), list(sys.argv[1:] if argv is None else argv)
    if study.modes and study.option not in args:
        args = [*study.mode(file), *args]
    return " ".join(["python -m bench", study.name, *args])


def results_dir(ref: str) -> Path:
    """Default results folder for ``--model ref``: ``bench/results/<short name>``."""
    path = Path(ref)
    name = (path.stem if path.suffix.lower() == ".gguf" else path.name) or "model"
    return RESULTS_DIR / RESULTS_FOLDERS.get(ref, name)
