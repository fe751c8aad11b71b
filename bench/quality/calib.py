"""Calibrated Q-Filters for the studies: the registry's artifact, or a fresh calibration.

A fresh calibration runs :mod:`qfserve.calibrations.capture` + :mod:`qfserve.calibrations.compute` on
training-split standard-library files (:func:`training.data.split_of`), never on the
evaluation split the studies measure on. The train files are shuffled with the seed and dealt
into two disjoint texts, ``A`` (even positions, the default) and ``B`` (odd positions), which
the stability study compares. Captured queries are cached in a temp folder keyed by the
weights, text and settings, so the five studies calibrate once.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.quality.common import progress
from bench.quality.data import split_files
from qfserve.calibrations.capture import capture_queries
from qfserve.calibrations.compute import compute_filters, query_scales
from qfserve.calibrations.corpus import make_sequences, read_documents
from qfserve.engine.filters.artifact import resolve_filters

CACHE_DIR = Path(
    os.environ.get("QFSERVE_BENCH_CACHE")
    or Path(tempfile.gettempdir()) / "qfserve-bench-calibration"
)
# (sequences, tokens per sequence, samples per head): the paper's / `qfserve calibrate`'s
# defaults in full mode, a few hundred tokens in quick mode.
FULL_SETTINGS = (20, 2048, 3000)
QUICK_SETTINGS = (3, 128, 300)


def text_files(text: str, seed: int = 0) -> list[Path]:
    """Training-split stdlib files of calibration text ``A`` or ``B`` (disjoint halves)."""
    if text not in ("A", "B"):
        raise ValueError(f"text must be 'A' or 'B', got {text!r}")
    files = list(split_files("train"))
    order = np.random.default_rng(seed).permutation(len(files))
    shuffled = [files[i] for i in order]
    return shuffled[0::2] if text == "A" else shuffled[1::2]


def describe_text(text: str, seed: int, used: int) -> str:
    return (
        f"text {text}: training-split stdlib *.py files (training.data.split_of == 'train'), "
        f"shuffled with seed {seed}, {'even' if text == 'A' else 'odd'} positions; "
        f"the beginnings of the first {used}"
    )


def capture(
    model: Any,
    tokenizer: Any,
    identity: dict[str, Any],
    *,
    text: str,
    settings: tuple[int, int, int],
    seed: int = 0,
) -> tuple[list[np.ndarray], dict[str, Any]]:
    """Sampled post-RoPE queries per layer ``(H, N, D)`` on calibration text, cached."""
    n_sequences, tokens, samples = settings
    context = identity.get("max_context") or tokens
    tokens = min(tokens, context)
    key = f"{identity['weights_sha1']}-{text}-{n_sequences}-{tokens}-{samples}-{seed}"
    path = CACHE_DIR / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.npz"
    if path.is_file():
        data = np.load(path, allow_pickle=False)
        queries = [data[f"layer{i}"] for i in range(identity["n_layers"])]
        return queries, {"description": str(data["description"]), "tokens": int(data["tokens"])}
    sequences, used = make_sequences(
        tokenizer,
        read_documents(text_files(text, seed)),
        n_sequences=n_sequences,
        tokens=tokens,
    )
    total = sum(len(s) for s in sequences)
    with progress(total=total, unit="tok", desc=f"calibrating on text {text}", leave=False) as bar:
        found = capture_queries(
            model, sequences, samples_per_head=samples, seed=seed, progress=bar.update
        )
    queries = [s.queries for s in found]
    description = describe_text(text, seed, used) + f"; {len(sequences)} x {tokens} tokens"
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(
        tmp,
        description=description,
        tokens=total,
        **{f"layer{i}": q for i, q in enumerate(queries)},
    )
    tmp.replace(path)
    return queries, {"description": description, "tokens": total}


class CalibratedFilters(np.ndarray):
    """``(n_layers, n_kv_heads, head_dim)`` filters that also carry the calibration's query
    scales ``(n_layers, n_kv_heads)`` (``query_scale``; ``None`` for a version-1 artifact)
    and any filters learned from traffic by name (``learned``, :func:`with_learned`), so
    studies pass one object to every arm and the adaptive and traffic arms find theirs."""

    query_scale: np.ndarray | None
    learned: dict[str, np.ndarray]

    def __new__(cls, filters: np.ndarray, query_scale: np.ndarray | None) -> CalibratedFilters:
        obj = np.asarray(filters, dtype=np.float32).view(cls)
        obj.query_scale = None if query_scale is None else np.asarray(query_scale, np.float32)
        obj.learned = {}
        return obj

    def __array_finalize__(self, obj: Any) -> None:
        self.query_scale = getattr(obj, "query_scale", None)
        self.learned = getattr(obj, "learned", {})


def with_learned(
    filters: np.ndarray, specs: list[str], identity: dict[str, Any]
) -> tuple[CalibratedFilters, dict[str, Any]]:
    """``filters`` carrying the artifacts named by ``specs`` (``NAME=PATH``, from
    :mod:`bench.quality.traffic`), each checked against the model; and a record of them.

    Raises:
        ValueError: a spec is not ``NAME=PATH``, or names one twice.
        CalibrationError: an artifact is for another model, shape or weights.
    """
    from qfserve.calibrations.artifact import load_calibration

    out = CalibratedFilters(np.asarray(filters), getattr(filters, "query_scale", None))
    out.learned = {}
    record = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        # A name is the arm name's last part: none that reads as a setting (r25, c8, w8, ada).
        if (not sep or not path or name in out.learned or not re.fullmatch(r"[a-z][a-z_-]*", name)
                or name == "ada"):  # fmt: skip
            raise ValueError(
                f"--traffic-artifacts takes distinct NAME=PATH with NAME in lower-case letters, "
                f"'_' and '-' (not 'ada'), got {spec!r}"
            )
        cal = load_calibration(
            path,
            model_id=identity["model_id"],
            n_layers=identity["n_layers"],
            n_kv_heads=identity["n_kv_heads"],
            head_dim=identity["head_dim"],
            weights=identity["fingerprint"],
        )
        out.learned[name] = cal.filters
        digest = hashlib.sha1(np.ascontiguousarray(cal.filters, np.float32).tobytes())
        record[name] = {"path": path, "text": cal.metadata.get("text"),
                        "sha1": digest.hexdigest()[:12]}  # fmt: skip
    return out, record


def filters_for(
    model: Any,
    tokenizer: Any,
    identity: dict[str, Any],
    *,
    mode: str = "auto",
    quick: bool = False,
    seed: int = 0,
) -> tuple[np.ndarray, dict[str, Any]]:
    """The calibrated filters the studies use, and a record of where they came from.

    Args:
        mode: ``auto`` (the registry's artifact when one exists, else fresh), ``registry``
            (raise without one) or ``fresh``.
    Returns:
        ``(n_layers, n_kv_heads, head_dim)`` float32 filters and a JSON-able record.
    """
    if mode not in ("auto", "registry", "fresh"):
        raise ValueError(f"mode must be 'auto', 'registry' or 'fresh', got {mode!r}")
    if mode != "fresh":
        filters, source = resolve_filters(
            model, identity["model_id"], fingerprint=identity["fingerprint"]
        )
        if filters is not None:
            from qfserve.calibrations.registry import find, load_for_model

            path = find(identity["model_id"])
            n_layers, n_kv, head_dim = filters.shape
            cal = load_for_model(
                identity["model_id"], n_layers=n_layers, n_kv_heads=n_kv, head_dim=head_dim
            )
            meta = cal.metadata if cal is not None else {}
            scale = cal.query_scale if cal is not None else None
            return CalibratedFilters(np.array(filters), scale), {
                "source": "registry",
                "path": str(path),
                "text": meta.get("text"),
                "samples_per_head": meta.get("samples_per_head"),
                "disjoint_from_eval": "unknown: check the artifact's text",
            }
        if mode == "registry":
            raise ValueError(
                f"no calibration artifact for {identity['model_id']!r} (mode=registry)"
            )
    settings = QUICK_SETTINGS if quick else FULL_SETTINGS
    queries, info = capture(model, tokenizer, identity, text="A", settings=settings, seed=seed)
    filters, summaries = compute_filters(queries, identity["n_kv_heads"])
    return CalibratedFilters(filters, query_scales(queries, filters)), {
        "source": "fresh",
        "text": info["description"],
        "tokens": info["tokens"],
        "samples_per_head": int(queries[0].shape[1]),
        "disjoint_from_eval": not (set(text_files("A", seed)) & set(split_files("eval"))),
        "anisotropy": summaries,
    }
