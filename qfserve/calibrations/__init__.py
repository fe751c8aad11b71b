"""Calibrated Q-Filters: capture a model's queries, compute its filters, store and find them.

Modules, in pipeline order: :mod:`~qfserve.calibrations.capture` (post-RoPE queries from any mlx-lm
model), :mod:`~qfserve.calibrations.compute` (uncentred SVD, sign anchoring, GQA averaging),
:mod:`~qfserve.calibrations.artifact` (the safetensors file), :mod:`~qfserve.calibrations.registry` (lookup
by model id), :mod:`~qfserve.calibrations.cli` (``qfserve calibrate``). Nothing here imports the
engine or the server.
"""

from qfserve.calibrations.artifact import (
    Calibration,
    CalibrationError,
    load_calibration,
    save_calibration,
)
from qfserve.calibrations.model_info import attention_shape
from qfserve.calibrations.registry import (
    CalibrationNotFoundError,
    available,
    find,
    load_for_model,
    model_id_for,
)

__all__ = [
    "Calibration",
    "CalibrationError",
    "CalibrationNotFoundError",
    "attention_shape",
    "available",
    "find",
    "load_calibration",
    "load_for_model",
    "model_id_for",
    "save_calibration",
]
