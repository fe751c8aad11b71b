"""Timing and its statistics: arms called round-robin in one process, read as medians and
interquartile ranges of per-round ratios against a reference arm."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.run import Run


def interleave(
    arms: dict[str, Callable[[], float]],
    reps: int,
    warmup: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, list[float]]:
    """Call each arm ``warmup + reps`` times, round-robin, keeping the measurements after the
    warm-up; ``progress(done, total)`` after every round."""
    samples: dict[str, list[float]] = {name: [] for name in arms}
    for rep in range(warmup + reps):
        for name, fn in arms.items():
            value = fn()
            if rep >= warmup:
                samples[name].append(value)
        if progress is not None:
            progress(rep + 1, warmup + reps)
    return samples


def timed(fn: Callable[[], Any]) -> Callable[[], float]:
    """An arm returning the seconds one evaluation of ``fn()`` (MLX arrays) takes."""
    import mlx.core as mx  # here, not at import: the report imports no MLX

    def run() -> float:
        tic = time.perf_counter()
        mx.eval(fn())
        return time.perf_counter() - tic

    return run


def summary(values: Sequence[float | None]) -> dict[str, float]:
    """Median, interquartile range, min and max of ``values`` (``None`` and NaN dropped)."""
    v = [float(x) for x in values if x is not None and math.isfinite(x)]
    if not v:
        return {"median": math.nan, "q1": math.nan, "q3": math.nan, "n": 0}
    q = statistics.quantiles(v, n=4) if len(v) >= 2 else [v[0]] * 3
    return {
        "median": statistics.median(v),
        "q1": q[0],
        "q3": q[2],
        "min": min(v),
        "max": max(v),
        "n": len(v),
    }


def ratio_row(samples: dict[str, list[float]], arm: str, reference: str) -> dict[str, Any]:
    """Median of per-repetition ratios ``arm / reference`` (pairs from the same round)."""
    ratios = [a / b for a, b in zip(samples[arm], samples[reference], strict=True)]
    return {"arm": arm, "reference": reference, **summary(ratios)}


def summaries(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {arm: summary(values) for arm, values in samples.items()}


def ratios(samples: dict[str, list[float]], reference: str, arms: Any) -> list[dict[str, Any]]:
    return [ratio_row(samples, arm, reference) for arm in arms]


def compare_arms(
    run: Run, arms: dict[str, Callable[[], float]], label: str, reference: str
) -> tuple[dict[str, list[float]], dict[str, dict[str, float]], list[dict[str, Any]]]:
    """Interleave ``arms`` for ``--reps`` rounds: the samples, their :func:`summaries` and
    every other arm's :func:`ratio_row` against ``reference``."""
    samples = interleave(arms, run.args.reps, progress=run.log.rounds(label))
    others = [a for a in samples if a != reference]
    return samples, summaries(samples), ratios(samples, reference, others)
