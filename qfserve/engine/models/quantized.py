"""Decode on the GGUF file's quantized weights, prefill on float32 ones.

On MLX's CPU backend the fast matrix product is float32 with a BLAS, and that is what a
prefill wants: hundreds of rows of activations against each weight, compute-bound. A decode
step is the opposite: one row per sequence, bound by the bytes of weights it reads, and
float32 weights are ~5x the bytes of the file's Q4_1/Q8_0 codes. So a converted GGUF folder
keeps both (``quantized.safetensors`` beside the float32 ``model.safetensors``), and each
projection with codes is wrapped here: up to :data:`MAX_ROWS` rows of activations go to
the native kernel (:mod:`qfserve.kernels.native`) on the codes, more go to the float32
weight. The codes dequantize to exactly the float32 weights (the conversion derives those
from them), so the two paths differ only in the order of float32 sums.

The same kernel module then also attends decode steps and prompt blocks
(:func:`qfserve.engine.kv.attention.set_native`), where MLX's CPU attention repeats a
grouped layer's keys to every query head on each call, and rotates, normalises and
activates (:mod:`qfserve.engine.models.native_layers`), where MLX on the CPU runs each as
several small ops, and runs a decode step's transformer block as two ops around its cache and
attention (:mod:`qfserve.engine.models.fused`).

Where the kernel cannot be built, nothing is wrapped and the model runs as before.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from qfserve.engine.kv.attention import set_native
from qfserve.engine.models import fused, native_layers
from qfserve.engine.models.gguf.convert import QUANTIZED_FILE

logger = logging.getLogger(__name__)

# Rows of activations up to which the kernel beats the float32 product (measured on SmolLM2's
# shapes with OpenBLAS: at 8 rows the kernel still reads 5x fewer bytes and wins; at 32 the
# BLAS's blocking wins). Decode of a batch of up to this many sequences takes the kernel.
MAX_ROWS = 8


class _Codes(nn.Module):
    """One weight's group-32 codes (``weight`` uint32, float32 ``scales`` and ``biases``),
    and the product with them."""

    def __init__(self, weight: mx.array, scales: mx.array, biases: mx.array, kernel: ModuleType):
        super().__init__()
        self.weight, self.scales, self.biases = weight, scales, biases
        self.bits = weight.shape[-1] // scales.shape[-1]  # (N, K*bits/32) words, (N, K/32)
        self._kernel = kernel

    def takes(self, x: mx.array) -> bool:
        """Whether ``x`` goes to the kernel: float32, at most :data:`MAX_ROWS` rows."""
        return x.dtype == mx.float32 and x.ndim > 0 and x.size // x.shape[-1] <= MAX_ROWS

    def __call__(self, x: mx.array) -> mx.array:  # (..., K) -> (..., N), any strides
        return cast(
            mx.array,
            self._kernel.quantized_matmul(x, self.weight, self.scales, self.biases, self.bits),
        )


class DecodeLinear(nn.Module):
    """An ``nn.Linear`` whose few-row products read its quantized codes."""

    def __init__(self, dense: nn.Linear, codes: _Codes):
        super().__init__()
        self.dense, self.codes = dense, codes

    @property
    def weight(self) -> mx.array:
        """The float32 weight (code that reads a projection's shape keeps working)."""
        return self.dense.weight

    def __call__(self, x: mx.array) -> mx.array:
        if not self.codes.takes(x):
            return self.dense(x)
        y = self.codes(x)
        return y + self.dense.bias if "bias" in self.dense else y


class DecodeEmbedding(nn.Module):
    """An ``nn.Embedding`` whose use as the tied output projection reads its codes (the
    largest product of a small model's step: SmolLM2's is 49,152 x 576)."""

    def __init__(self, dense: nn.Embedding, codes: _Codes):
        super().__init__()
        self.dense, self.codes = dense, codes

    @property
    def weight(self) -> mx.array:
        return self.dense.weight

    def __call__(self, ids: mx.array) -> mx.array:
        return self.dense(ids)

    def as_linear(self, x: mx.array) -> mx.array:
        if not self.codes.takes(x):
            return self.dense.as_linear(x)
        return self.codes(x)


def attach(model: nn.Module, folder: str | Path, kernel: ModuleType | None) -> int:
    """Wrap every float32 projection of ``model`` whose codes ``folder`` holds.

    Returns:
        How many modules were wrapped (0 without a kernel or a codes file).
    """
    path = Path(folder) / QUANTIZED_FILE
    if kernel is None or not path.is_file():
        return 0
    loaded = mx.load(str(path))
    assert isinstance(loaded, dict)
    modules = dict(model.named_modules())
    wrapped: list[tuple[str, nn.Module]] = []
    for key in loaded:
        if not key.endswith(".scales"):
            continue
        stem = key[: -len(".scales")]
        dense = modules.get(stem)
        if not isinstance(dense, nn.Linear | nn.Embedding) or dense.weight.dtype != mx.float32:
            continue
        codes = _Codes(loaded[f"{stem}.weight"], loaded[key], loaded[f"{stem}.biases"], kernel)
        if (codes.weight.shape[0], codes.scales.shape[-1] * 32) != tuple(dense.weight.shape):
            raise ValueError(f"{path}: {stem}'s codes do not match its weight's shape")
        if isinstance(dense, nn.Linear):
            wrapped.append((stem, DecodeLinear(dense, codes)))
        else:
            wrapped.append((stem, DecodeEmbedding(dense, codes)))
    model.update_modules(_tree(wrapped))
    mx.eval(model.parameters())
    if wrapped:  # the same kernel module attends (kv.attention), rotates, normalises, ...
        set_native(kernel)
        native_layers.install(model, kernel)
        fused.install(model, kernel)
    logger.info("decode reads quantized weights for %d projections (%s)", len(wrapped), path)
    return len(wrapped)


def detach(model: nn.Module) -> int:
    """Put back the plain modules :func:`attach` wrapped, MLX's attention and the layers
    :mod:`native_layers` swapped (before splitting the model over ranks, whose sharding
    rewrites the projections). Returns how many projections."""
    plain = [
        (name, module.dense)
        for name, module in model.named_modules()
        if isinstance(module, DecodeLinear | DecodeEmbedding)
    ]
    model.update_modules(_tree(plain))
    set_native(None)
    fused.remove(model)
    native_layers.remove(model)
    return len(plain)


def _tree(items: Sequence[tuple[str, nn.Module]]) -> dict[str, Any]:
    from mlx.utils import tree_unflatten

    return tree_unflatten(list(items)) if items else {}
