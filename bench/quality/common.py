"""Shared plumbing of the quality studies: command line, model identity, tables, JSON output."""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.harness import RESULTS_DIR

REPO = Path(__file__).resolve().parents[2]
DEFAULT_MODEL = str(REPO / "models" / "qfserve-tiny")


def base_parser(description: str) -> argparse.ArgumentParser:
    """Arguments every study takes: ``--model``, ``--quick``, ``--out``, ``--calibration``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help="GGUF file, mlx-lm folder or catalog name (default: bundled qfserve-tiny)",
    )
    p.add_argument("--quick", action="store_true", help="CI-sized smoke run (tiny sizes)")
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    p.add_argument(
        "--calibration",
        choices=("auto", "registry", "fresh"),
        default="auto",
        help="calibrated filters: the registry's artifact if one exists (auto), only the "
        "registry, or always calibrate afresh on held-in training text",
    )
    p.add_argument("--seed", type=int, default=0)
    return p


def load_model(path: str) -> tuple[Any, Any, dict[str, Any]]:
    """``(model, tokenizer, identity)`` where identity names the exact weights measured."""
    import mlx_lm

    from calibrations.model_info import (
        attention_modules,
        head_counts,
        max_context,
        model_fingerprint,
    )
    from calibrations.registry import model_id_for
    from engine.loading import resolve_model_ref

    path = resolve_model_ref(path)  # a GGUF file or catalog name becomes its converted folder
    model, tokenizer, config = mlx_lm.load(path, return_config=True)
    folder = Path(path)
    weights = sorted(folder.glob("*.safetensors"))
    digest = hashlib.sha1()
    for w in weights:
        digest.update(w.read_bytes())
    state_file = folder / "training_state.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else None
    n_heads, n_kv_heads, head_dim = head_counts(attention_modules(model)[0], model)
    identity = {
        "path": str(folder.resolve().relative_to(REPO))
        if folder.resolve().is_relative_to(REPO)
        else str(folder),
        "model_id": model_id_for(path),
        "weights_sha1": digest.hexdigest()[:12],
        "fingerprint": model_fingerprint(model, config),
        "training_state": state,
        "checkpoint": checkpoint_label(state),
        "n_layers": len(attention_modules(model)),
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "head_dim": head_dim,
        "max_context": max_context(model),
    }
    return model, tokenizer, identity


def checkpoint_label(state: dict[str, Any] | None) -> str:
    """``"qfserve-tiny-recall step 1952 (18,711,040 training tokens)"`` from
    ``training_state.json``, or ``"unknown"``."""
    if not state:
        return "unknown (no training_state.json)"
    run = f"{state['run']} " if state.get("run") else ""
    return f"{run}step {state.get('step')} ({state.get('tokens_seen', 0):,} training tokens)"


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


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> None:
    """A fixed-width table on stdout; floats with 3 significant decimals."""

    def fmt(x: Any) -> str:
        if isinstance(x, float):
            return "nan" if not np.isfinite(x) else f"{x:.3f}"
        return str(x)

    cells = [[fmt(c) for c in r] for r in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    if title:
        print(f"\n{title}")
    print("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    for r in cells:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)))


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return _jsonable(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not np.isfinite(x):
        return None  # JSON has no NaN
    if isinstance(x, Path):
        return str(x)
    return x


def command_line(study: str, argv: Sequence[str] | None) -> str:
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python -m", f"bench.quality.{study}", *args])


def write_results(study: str, payload: dict[str, Any], out_dir: Path, started: float) -> Path:
    """Write ``<out_dir>/<study>.json`` with the run's date, machine and runtime."""
    from bench.harness import machine

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{study}.json"
    data = {
        "benchmark": study,
        "section": "quality",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "runtime_s": round(time.perf_counter() - started, 1),
        "machine": machine(),
        **payload,
    }
    path.write_text(json.dumps(_jsonable(data), indent=1) + "\n")
    return path


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

    from engine.blas import reexec_with_openblas

    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
    reexec_with_openblas()
    return main()
