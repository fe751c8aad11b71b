"""What calibration needs to know about an mlx-lm model's attention: layers and head counts.

mlx-lm models expose their blocks as ``model.layers``, each with a ``self_attn`` module that
holds ``n_heads``, ``n_kv_heads`` and (usually) ``head_dim``, and rotates queries and keys with
``self_attn.rope``. Models whose attention looks different are refused with a clear error.
"""

from __future__ import annotations

import hashlib
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def attention_modules(model: nn.Module) -> list[Any]:
    """The ``self_attn`` module of every layer, in layer order.

    Raises:
        ValueError: the model has no ``layers`` or a layer has no ``self_attn``.
    """
    layers = getattr(model, "layers", None)
    if layers is None:
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
    if not layers:
        raise ValueError(
            f"model must expose its transformer blocks as `model.layers`; "
            f"{type(model).__name__} does not"
        )
    modules = []
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        if attn is None:
            raise ValueError(
                f"layer {i} of {type(model).__name__} has no `self_attn`; calibrated Q-Filters "
                "need a standard attention block in every layer"
            )
        modules.append(attn)
    return modules


def _args(model: nn.Module) -> Any:
    return getattr(model, "args", None) or getattr(getattr(model, "model", None), "args", None)


def head_counts(attn: Any, model: nn.Module | None = None) -> tuple[int, int, int]:
    """``(n_heads, n_kv_heads, head_dim)`` of one attention module.

    ``head_dim`` comes from the module, else the model's args (``head_dim``, else
    ``hidden_size // num_attention_heads``), as mlx-lm's own model files compute it.

    Raises:
        ValueError: the counts cannot be found.
    """
    n_heads = getattr(attn, "n_heads", None)
    n_kv_heads = getattr(attn, "n_kv_heads", None)
    head_dim = getattr(attn, "head_dim", None)
    args = _args(model) if model is not None else None
    if head_dim is None and args is not None and n_heads:
        head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    if not (n_heads and n_kv_heads and head_dim):
        raise ValueError(
            f"cannot read (n_heads, n_kv_heads, head_dim) from {type(attn).__name__}: got "
            f"({n_heads}, {n_kv_heads}, {head_dim})"
        )
    if n_heads % n_kv_heads:
        raise ValueError(
            f"n_heads must be a multiple of n_kv_heads for grouped-query attention, got "
            f"n_heads={n_heads}, n_kv_heads={n_kv_heads}"
        )
    return int(n_heads), int(n_kv_heads), int(head_dim)


def attention_shape(model: nn.Module) -> tuple[int, int, int]:
    """``(n_layers, n_kv_heads, head_dim)``: the shape of the model's Q-Filters tensor.

    Raises:
        ValueError: the model's attention is not a standard mlx-lm block, or its layers
            disagree on ``n_kv_heads`` / ``head_dim`` (one tensor cannot hold them).
    """
    modules = attention_modules(model)
    shapes = {head_counts(attn, model)[1:] for attn in modules}
    if len(shapes) != 1:
        raise ValueError(
            f"layers must share (n_kv_heads, head_dim) to hold one filters tensor, got "
            f"{sorted(shapes)}"
        )
    n_kv_heads, head_dim = shapes.pop()
    return len(modules), n_kv_heads, head_dim


def max_context(model: nn.Module) -> int | None:
    """The model's trained context length (``max_position_embeddings``), when it says."""
    args = _args(model)
    value = getattr(args, "max_position_embeddings", None) if args is not None else None
    return int(value) if value else None


def weights_fingerprint(model: nn.Module) -> str:
    """A short digest of the weights that shape queries and keys, recorded in an artifact.

    Hashes ``q_proj`` and ``k_proj`` of the first and last attention layers (exact bytes,
    shapes and dtypes): enough to tell a retrained or differently quantized copy that shares
    the model id, and cheap even for large models. ``""`` when the layers name them otherwise.
    """
    modules = attention_modules(model)
    digest = hashlib.sha256()
    for attn in (modules[0], modules[-1]):
        for name in ("q_proj", "k_proj"):
            weight = getattr(getattr(attn, name, None), "weight", None)
            if not isinstance(weight, mx.array):
                return ""
            data = np.array(weight.view(mx.uint8) if weight.dtype == mx.bfloat16 else weight)
            digest.update(f"{name}{weight.shape}{weight.dtype}".encode())
            digest.update(np.ascontiguousarray(data).tobytes())
    return digest.hexdigest()[:16]


# A converted model's config.json may record the fingerprint of the file it came from.
FINGERPRINT_KEY = "qfserve_weights_fingerprint"


def model_fingerprint(model: nn.Module, config: dict[str, Any] | None = None) -> str:
    """The fingerprint an artifact is checked against: ``config[FINGERPRINT_KEY]`` when the
    model was converted (a GGUF file dequantized to float32 and the same file kept quantized
    hold different bytes but are one model), else :func:`weights_fingerprint`."""
    recorded = (config or {}).get(FINGERPRINT_KEY)
    if isinstance(recorded, str) and recorded:
        return recorded
    return weights_fingerprint(model)
