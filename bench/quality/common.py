"""What the quality studies share beyond :mod:`bench.cli`, :mod:`bench.models` and
:mod:`bench.harness`: spreads of per-sequence figures, progress bars, the entry point."""

from __future__ import annotations

import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, interquartile range, min and max of ``values`` (NaNs dropped)."""
    v = [float(x) for x in values if x is not None and np.isfinite(x)]
    if not v:
        return {"median": float("nan"), "q1": float("nan"), "q3": float("nan"), "n": 0}
    q = statistics.quantiles(v, n=4) if len(v) >= 2 else [v[0]] * 3
    return {
        "median": statistics.median(v),
        "q1": q[0],
        "q3": q[2],
        "min": min(v),
        "max": max(v),
        "n": len(v),
    }


def progress(**kwargs: Any) -> Any:
    """A tqdm bar; in a log file (no terminal) it writes a line every 30 s, not every step."""
    from tqdm import tqdm

    if not sys.stderr.isatty():
        kwargs.setdefault("mininterval", 30.0)
    return tqdm(**kwargs)


def run(main: Callable[[], int]) -> int:
    """Entry point of a study: OpenBLAS for MLX (re-executes once), then ``main()``.

    numpy's own OpenBLAS spins its thread pool on every tiny SVD; on a loaded two-core
    machine that costs up to a second per call, so one thread is the default here.
    """
    import os

    from qfserve.engine.models.blas import reexec_with_openblas

    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    reexec_with_openblas()
    return main()
