"""Calibrated Q-Filters: capture a model's queries, compute its filters, store and find them.

Modules, in pipeline order: :mod:`~calibrations.capture` (post-RoPE queries from any mlx-lm
model), :mod:`~calibrations.compute` (uncentred SVD, sign anchoring, GQA averaging),
:mod:`~calibrations.artifact` (the safetensors file), :mod:`~calibrations.registry` (lookup
by model id), :mod:`~calibrations.cli` (``qfserve calibrate``). Nothing here imports the
engine or the server.
"""

from calibrations.artifact import Calibration, CalibrationError, load_calibration, save_calibration
from calibrations.model_info import attention_shape
from calibrations.registry import (
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
