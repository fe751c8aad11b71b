"""The engine's one door to calibrated Q-Filters: look a model up in the calibration registry.

A model with an artifact gets its calibrated filters; a model without one gets ``None`` and
its caches use the key-SVD fallback (and say so in their statistics). A bad artifact (wrong
model, wrong shape, truncated, non-finite) raises: it is never silently replaced.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from qfserve.calibrations.model_info import attention_shape, weights_fingerprint
from qfserve.calibrations.registry import (
    CalibrationNotFoundError,
    find,
    load_for_model,
    model_id_for,
)


def resolve_filters(
    model: nn.Module, model_id: str, *, fingerprint: str | None = None
) -> tuple[mx.array | None, str]:
    """Calibrated filters for ``model``, or none (:func:`resolve_calibration` without the
    query scales)."""
    filters, _, source = resolve_calibration(model, model_id, fingerprint=fingerprint)
    return filters, source


def resolve_calibration(
    model: nn.Module, model_id: str, *, fingerprint: str | None = None
) -> tuple[mx.array | None, mx.array | None, str]:
    """Calibrated filters for ``model`` and their query scales, or none.

    Args:
        model: The loaded mlx-lm model (its attention shape is checked against the file).
        model_id: Its registry id, e.g. a Hugging Face id; a local folder is mapped to its id
            with :func:`qfserve.calibrations.registry.model_id_for`.
        fingerprint: The model's weights fingerprint
            (:func:`qfserve.calibrations.model_info.model_fingerprint`); default: computed from
            its tensors.
    Returns:
        ``(filters, query_scale, "calibrated")`` with filters ``[n_layers, n_kv_heads,
        head_dim]`` float32 and query scales ``[n_layers, n_kv_heads]`` (``None`` for a
        calibration older than format version 2), or ``(None, None, "fallback")`` when no
        artifact exists for the model.
    Raises:
        qfserve.calibrations.artifact.CalibrationError: an artifact exists but must not be used
            (another model, other weights of this one, wrong shape, damaged file).
        ValueError: an artifact exists but the model's attention shape cannot be read.
    """
    model_id = model_id_for(model_id)
    try:
        find(model_id)
    except CalibrationNotFoundError:
        # Checked before reading the model's shape, so models calibrations cannot handle
        # (no standard attention) still run on the fallback when nobody calibrated them.
        return None, None, "fallback"
    n_layers, n_kv_heads, head_dim = attention_shape(model)
    calibration = load_for_model(
        model_id,
        n_layers=n_layers,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        weights=fingerprint or weights_fingerprint(model),
    )
    if calibration is None:  # removed between the two look-ups
        return None, None, "fallback"
    scale = calibration.query_scale
    return (
        mx.array(calibration.filters, dtype=mx.float32),
        None if scale is None else mx.array(scale, dtype=mx.float32),
        "calibrated",
    )
