"""Calibration artifacts: one safetensors file of Q-Filters per model, saved and validated.

qfserve's format holds a ``filters`` tensor ``[n_layers, n_kv_heads, head_dim]`` float32 of
unit rows, from version 2 a ``query_scale`` tensor ``[n_layers, n_kv_heads]`` float32 (each
KV head's mean query projection on its filter, ``E<q, f>``: what makes projections comparable
across heads), plus string metadata::

    format            "qfserve-qfilters"
    format_version    "2" (version "1" files, without ``query_scale``, still load)
    model_id          the model the filters were calibrated on
    n_sequences       calibration sequences
    tokens_per_sequence
    samples_per_head  sampled query positions per head
    text              what the calibration text was
    post_rope         "true": queries were captured after RoPE
    created           ISO-8601 UTC timestamp
    anisotropy        JSON list, one {layer, positive_share, top_energy, drift_ratio} per layer
    weights           optional: a digest of the calibrated model's q/k projections
                      (:func:`qfserve.calibrations.model_info.weights_fingerprint`); a model with the
                      same id but other weights (retrained, requantized) is refused

The Q-Filters authors publish a safetensors file holding only a ``q_filters`` tensor of the
same shape; it loads too (its model id comes from the caller). Their scorer (kvpress's
``QFilterPress``) ranks keys by ``-(q_filters . k)``, higher kept, while ours ranks by
``+(filters . k)``, so their filters are negated on load to mean the same thing here.

Every problem with a file (unreadable, truncated, wrong version, wrong model, wrong shape,
non-finite values) raises :class:`CalibrationError`, a ``ValueError`` naming the file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn, cast

import mlx.core as mx
import numpy as np
from safetensors.numpy import save_file

FORMAT_NAME = "qfserve-qfilters"
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)
FILTERS_KEY = "filters"
SCALE_KEY = "query_scale"
AUTHORS_KEY = "q_filters"
# kvpress keeps keys with a high -(q_filters . k); we keep a high +(filters . k).
AUTHORS_SIGN = -1.0
_UNIT_TOL = 1e-3
_REQUIRED = (
    "format",
    "format_version",
    "model_id",
    "n_sequences",
    "tokens_per_sequence",
    "samples_per_head",
    "text",
    "post_rope",
    "created",
    "anisotropy",
)


class CalibrationError(ValueError):
    """A calibration file that must not be used; the message names the file."""

    def __init__(self, path: str | Path, reason: str):
        self.path = Path(path)
        super().__init__(f"calibration file {self.path}: {reason}")


@dataclass(frozen=True)
class Calibration:
    """Q-Filters of one model, loaded and validated.

    Attributes:
        filters: ``(n_layers, n_kv_heads, head_dim)`` float32 unit rows; keys with a larger
            projection on a filter are the ones to keep.
        model_id: The model they belong to.
        metadata: Parsed metadata (ints, ``post_rope`` bool, ``anisotropy`` list); for the
            authors' format only ``format`` and ``post_rope`` (``None``, not recorded).
        path: The file they came from, if any.
        format: ``"qfserve"`` or ``"q_filters"`` (the authors' format).
        query_scale: ``(n_layers, n_kv_heads)`` float32 ``E<q, f>``, or ``None`` where the
            file predates it (version 1) or is the authors' format.
    """

    filters: np.ndarray
    model_id: str | None
    metadata: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None
    format: str = "qfserve"
    query_scale: np.ndarray | None = None

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(n_layers, n_kv_heads, head_dim)``."""
        return tuple(self.filters.shape)  # type: ignore[return-value]


def _unit_rows(
    filters: np.ndarray, fail: Callable[[str], NoReturn]
) -> tuple[np.ndarray, np.ndarray]:
    """``filters`` checked (rank 3, finite, no zero row) and their row norms ``(L, H, 1)``."""
    if filters.ndim != 3 or 0 in filters.shape:
        fail(f"filters must have shape [n_layers, n_kv_heads, head_dim], got {filters.shape}")
    if not np.isfinite(filters).all():
        fail("filters contain non-finite values (NaN or inf)")
    norms = np.linalg.norm(filters.astype(np.float64), axis=-1, keepdims=True)
    if (norms < 1e-8).any():
        fail("filters contain an all-zero row")
    return filters, norms


def save_calibration(
    path: str | Path,
    filters: np.ndarray,
    *,
    model_id: str,
    n_sequences: int,
    tokens_per_sequence: int,
    samples_per_head: int,
    text: str,
    anisotropy: Sequence[dict[str, Any]] = (),
    post_rope: bool = True,
    created: datetime | None = None,
    weights: str = "",
    query_scale: np.ndarray | None = None,
) -> Path:
    """Write an artifact in qfserve's format (atomically: never a half-written file).

    Args:
        path: Destination ``.safetensors`` file; parent folders are created.
        filters: ``(n_layers, n_kv_heads, head_dim)``; rows are renormalised to unit length.
        model_id: The model the filters belong to (non-empty).
        n_sequences, tokens_per_sequence, samples_per_head: How they were calibrated.
        text: Description of the calibration text.
        anisotropy: One summary dict per layer (from :func:`qfserve.calibrations.compute.compute_filters`).
        post_rope: Whether queries were captured after RoPE.
        created: Timestamp; default now (UTC).
        weights: The model's weights fingerprint; recorded when non-empty.
        query_scale: ``(n_layers, n_kv_heads)`` ``E<q, f>`` (from
            :func:`qfserve.calibrations.compute.query_scales`); required by format version 2.
    Returns:
        The path written.
    Raises:
        ValueError: empty ``model_id``, filters of the wrong rank, non-finite or zero rows,
            or a missing, misshapen or non-finite ``query_scale``.
    """
    path = Path(path)
    if not model_id:
        raise ValueError(f"model_id must be a non-empty string, got {model_id!r}")

    def fail(reason: str) -> NoReturn:
        raise ValueError(f"cannot save {path}: {reason}")

    filters, norms = _unit_rows(np.asarray(filters), fail)
    unit = (filters / norms).astype(np.float32)
    if query_scale is None:
        fail("query_scale is required (format version 2)")
    scale = _check_scale(np.asarray(query_scale, dtype=np.float32), unit.shape, fail)
    metadata = {
        "format": FORMAT_NAME,
        "format_version": str(FORMAT_VERSION),
        "model_id": model_id,
        "n_sequences": str(int(n_sequences)),
        "tokens_per_sequence": str(int(tokens_per_sequence)),
        "samples_per_head": str(int(samples_per_head)),
        "text": text,
        "post_rope": "true" if post_rope else "false",
        "created": (created or datetime.now(timezone.utc)).isoformat(timespec="seconds"),
        "anisotropy": json.dumps(list(anisotropy)),
    }
    if weights:
        metadata["weights"] = weights
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tensors = {FILTERS_KEY: np.ascontiguousarray(unit), SCALE_KEY: scale}
        save_file(tensors, str(tmp), metadata=metadata)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _check_scale(
    scale: np.ndarray, filters_shape: tuple[int, ...], fail: Callable[[str], NoReturn]
) -> np.ndarray:
    if scale.shape != tuple(filters_shape[:2]):
        fail(f"query_scale must have shape {tuple(filters_shape[:2])}, got {scale.shape}")
    if not np.isfinite(scale).all():
        fail("query_scale contains non-finite values (NaN or inf)")
    return np.ascontiguousarray(scale.astype(np.float32))


def _parse_metadata(meta: dict[str, str], fail: Callable[[str], NoReturn]) -> dict[str, Any]:
    missing = [k for k in _REQUIRED if k not in meta]
    if meta.get("format") != FORMAT_NAME:
        fail(f"format is {meta.get('format')!r}, expected {FORMAT_NAME!r}")
    if meta.get("format_version") not in {str(v) for v in READ_VERSIONS}:
        fail(
            f"format_version is {meta.get('format_version')!r}; this qfserve reads versions "
            f"{', '.join(map(str, READ_VERSIONS))} (recalibrate with `qfserve calibrate`)"
        )
    if missing:
        fail(f"metadata is missing {missing}")
    parsed: dict[str, Any] = dict(meta)
    try:
        for key in ("format_version", "n_sequences", "tokens_per_sequence", "samples_per_head"):
            parsed[key] = int(meta[key])
        parsed["anisotropy"] = json.loads(meta["anisotropy"])
    except (ValueError, json.JSONDecodeError) as e:
        fail(f"metadata is malformed ({e})")
    parsed["post_rope"] = meta["post_rope"] == "true"
    return parsed


def read_calibration(path: str | Path, *, model_id: str | None = None) -> Calibration:
    """Read and validate a file on its own (no check against a model).

    Args:
        path: qfserve's format or the authors' ``q_filters`` format.
        model_id: Model id to record for the authors' format, which stores none.
    Raises:
        FileNotFoundError: no such file.
        CalibrationError: unreadable, truncated, wrong format version, or bad values.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"calibration file {path} does not exist")

    def fail(reason: str) -> NoReturn:
        raise CalibrationError(path, reason)

    try:
        # mx.load's stub returns a union over every format; safetensors with
        # return_metadata=True gives (name -> array, str -> str metadata).
        tensors, meta = cast(
            "tuple[dict[str, mx.array], dict[str, str]]",
            mx.load(str(path), format="safetensors", return_metadata=True),
        )
    except Exception as e:  # mlx raises RuntimeError/ValueError with its own wording
        raise CalibrationError(
            path,
            f"is not a readable safetensors file, likely truncated or "
            f"corrupt ({e}); recalibrate or fetch it again",
        ) from None
    if not isinstance(tensors, dict):
        fail("is not a safetensors file")
    if FILTERS_KEY in tensors:
        parsed = _parse_metadata(dict(meta or {}), fail)
        filters = np.array(tensors[FILTERS_KEY].astype(mx.float32))
        filters, norms = _unit_rows(filters, fail)
        if np.abs(norms - 1.0).max() > _UNIT_TOL:
            fail(f"filter rows must be unit length, found norms up to {norms.max():.4g}")
        scale = None
        if parsed["format_version"] >= 2:
            if SCALE_KEY not in tensors:
                fail(f"format_version {parsed['format_version']} needs a {SCALE_KEY!r} tensor")
            scale = _check_scale(
                np.array(tensors[SCALE_KEY].astype(mx.float32)), filters.shape, fail
            )
        return Calibration(
            filters.astype(np.float32), parsed["model_id"], parsed, path, query_scale=scale
        )
    if AUTHORS_KEY in tensors:
        raw = np.array(tensors[AUTHORS_KEY].astype(mx.float32))
        raw, norms = _unit_rows(raw, fail)
        filters = (AUTHORS_SIGN * raw / norms).astype(np.float32)
        parsed = {"format": AUTHORS_KEY, "post_rope": None}
        return Calibration(filters, model_id, parsed, path, format=AUTHORS_KEY)
    fail(f"holds neither a {FILTERS_KEY!r} nor a {AUTHORS_KEY!r} tensor (found {sorted(tensors)})")
    raise AssertionError("unreachable")


def check_calibration(
    calibration: Calibration,
    *,
    model_id: str | None = None,
    accept_ids: Iterable[str] = (),
    n_layers: int | None = None,
    n_kv_heads: int | None = None,
    head_dim: int | None = None,
    weights: str = "",
) -> Calibration:
    """Check a calibration against the model it is about to be used for.

    Args:
        calibration: From :func:`read_calibration`.
        model_id: The model's id; a stored id must equal it or one of ``accept_ids``.
        accept_ids: Other ids that name the same filters (an alias's base model).
        n_layers, n_kv_heads, head_dim: The model's attention shape, each checked if given.
        weights: The model's weights fingerprint. When the file records one for this very id
            (not reached through an alias, which names a variant on purpose), they must match.
    Returns:
        ``calibration``, with ``model_id`` filled in when the file stored none.
    Raises:
        CalibrationError: model id, shape or weights mismatch.
    """
    path = calibration.path or Path("<in memory>")
    stored = calibration.model_id
    if model_id is not None and stored is not None and stored not in {model_id, *accept_ids}:
        raise CalibrationError(
            path,
            f"was calibrated for model {stored!r}, not {model_id!r}; filters are model-specific",
        )
    expected = (n_layers, n_kv_heads, head_dim)
    for name, want, got in zip(
        ("n_layers", "n_kv_heads", "head_dim"), expected, calibration.shape, strict=True
    ):
        if want is not None and want != got:
            raise CalibrationError(
                path,
                f"has filters of shape {calibration.shape} (n_layers, n_kv_heads, "
                f"head_dim) but the model needs {name}={want}, got {got}",
            )
    recorded = calibration.metadata.get("weights", "")
    if weights and recorded and stored == model_id and recorded != weights:
        raise CalibrationError(
            path,
            f"was calibrated on other weights of {stored!r} (fingerprint {recorded}, this "
            f"model's is {weights}); recalibrate with `qfserve calibrate`",
        )
    if stored is None and model_id is not None:
        return Calibration(
            calibration.filters,
            model_id,
            calibration.metadata,
            calibration.path,
            calibration.format,
            calibration.query_scale,
        )
    return calibration


def load_calibration(
    path: str | Path,
    *,
    model_id: str | None = None,
    accept_ids: Iterable[str] = (),
    n_layers: int | None = None,
    n_kv_heads: int | None = None,
    head_dim: int | None = None,
    weights: str = "",
) -> Calibration:
    """:func:`read_calibration` then :func:`check_calibration` (same arguments)."""
    calibration = read_calibration(path, model_id=model_id)
    return check_calibration(
        calibration,
        model_id=model_id,
        accept_ids=accept_ids,
        n_layers=n_layers,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        weights=weights,
    )
