"""Shared benchmark plumbing: interleaved arms, medians with spread, JSON results, tables.

Machines running these are shared and noisy, so arms always run in the same process,
interleaved (A B A B ...), and results are read as ratios against a reference arm, with an
A/A pair (the reference against itself) showing the noise floor.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def interleave(
    arms: dict[str, Callable[[], float]],
    reps: int,
    warmup: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, list[float]]:
    """Run each arm ``warmup + reps`` times, round-robin; each call returns one measurement.

    ``progress(done, total)`` is called after every round (warm-up rounds included).
    """
    samples: dict[str, list[float]] = {name: [] for name in arms}
    total = warmup + reps
    for rep in range(total):
        for name, fn in arms.items():
            value = fn()
            if rep >= warmup:
                samples[name].append(value)
        if progress is not None:
            progress(rep + 1, total)
    return samples


def summary(values: list[float]) -> dict[str, float]:
    """Median and spread (min, max, interquartile range) of one arm's measurements."""
    q = statistics.quantiles(values, n=4) if len(values) >= 2 else [values[0]] * 3
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "q1": q[0],
        "q3": q[2],
        "n": len(values),
    }


def ratio_row(samples: dict[str, list[float]], arm: str, reference: str) -> dict[str, float]:
    """Median of per-repetition ratios ``arm / reference`` (pairs from the same round)."""
    ratios = [a / b for a, b in zip(samples[arm], samples[reference], strict=True)]
    return {"arm": arm, "reference": reference, **summary(ratios)}


def _training_running() -> bool:
    # Another project process (the model's training) often shares the cores; say so.
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if b"training.train" in cmdline.read_bytes():
                return True
        except OSError:
            continue
    return False


def machine() -> dict[str, Any]:
    """Platform, MLX, BLAS, cores and how busy the machine was when the run wrote its JSON."""
    import mlx.core as mx

    from qfserve.engine.models.blas import blas_summary

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.machine(),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "blas": blas_summary(),
        "cpu_count": os.cpu_count(),
    }
    if hasattr(os, "getloadavg"):
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    if _training_running():
        info["notes"] = (
            "shared machine: a model was training in the background on the same cores "
            "during this run, so absolute timings are inflated and noisy; read the ratios "
            "against the A/A rows"
        )
    return info


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if hasattr(x, "tolist"):  # numpy arrays and scalars
        return _jsonable(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return None  # JSON has no NaN
    if isinstance(x, Path):
        return str(x)
    return x


def write_results(
    name: str,
    payload: dict[str, Any],
    out: Path,
    *,
    section: str,
    started: float | None = None,
) -> Path:
    """Write ``<out>/<name>.json``: the study's payload with its date, machine, section
    (``quality`` or ``speed``) and, given the ``time.perf_counter()`` it started at, runtime."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    data: dict[str, Any] = {
        "benchmark": name,
        "section": section,
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
    }
    if started is not None:
        data["runtime_s"] = round(time.perf_counter() - started, 1)
    data.update(payload)
    path.write_text(json.dumps(_jsonable(data), indent=1) + "\n")
    return path


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> None:
    """A fixed-width table on stdout, right-aligned; floats with 3 significant digits."""

    def fmt(x: Any) -> str:
        if isinstance(x, float):
            if not math.isfinite(x):
                return "nan"
            return f"{x:.3g}" if abs(x) < 1000 else f"{x:.0f}"
        return str(x)

    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    if title:
        print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))
