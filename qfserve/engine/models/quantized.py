"""Quantized weights on the CPU, held as their codes: no float32 copy of the model.

A converted GGUF folder (and an ``mlx_lm.convert -q`` one) holds its matrices as MLX affine
codes, which ``mlx_lm.load`` builds ``nn.QuantizedLinear`` / ``nn.QuantizedEmbedding`` layers
from. On Metal those run on MLX's own quantized kernels. On MLX's CPU backend its
``quantized_matmul`` is several times slower than a float32 product, so :func:`attach` gives
each such layer a subclass whose products go to qfserve's native kernel
(:mod:`qfserve.kernels.native`): few rows of activations (decode) are multiplied on the codes
in registers, more (a prompt) a dequantized tile of the weight at a time through the BLAS.
Either way only the codes stay resident: SmolLM2-135M holds ~100 MB of weights, not ~655 MB.

The same kernel module then also attends decode steps and prompt blocks
(:func:`qfserve.engine.kv.attention.set_native`), where MLX's CPU attention repeats a
grouped layer's keys to every query head on each call, and rotates, normalises and
activates (:mod:`qfserve.engine.models.native_layers`), where MLX on the CPU runs each as
several small ops, and runs a decode step's transformer block as two ops around its cache and
attention (:mod:`qfserve.engine.models.fused`).

A decode step's few rows of activations are rounded to integers per block of 32 where the CPU
has AVX-512 VNNI or AVX2 (:func:`set_decode_activations`), so that the codes never become floats:
31-bit integers by default (float32's precision; greedy text unchanged), int16 or int8
(llama.cpp's arithmetic for its quantized types) on request, each faster and less exact
(docs/models.md gives both).

Where the kernel cannot be built, :func:`densify` turns the quantized layers into float32
ones instead (MLX's float32 product is the fast one it has): the speed of the BLAS, at ~5x
the memory.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from types import ModuleType
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from qfserve.engine.kv.attention import set_native
from qfserve.engine.models import fused, native_layers

logger = logging.getLogger(__name__)

# What the native kernel reads (MLX's affine mode).
KERNEL_BITS = frozenset({4, 5, 6, 8})
KERNEL_GROUPS = frozenset({32, 64, 128})


def kernel_of(model: nn.Module) -> ModuleType | None:
    """The native kernel module ``model``'s quantized layers read through, if any."""
    for _, module in model.named_modules():
        kernel = getattr(module, "_qfserve_kernel", None)
        if kernel is not None:
            return cast(ModuleType, kernel)
    return None


def decode_activations(model: nn.Module) -> str | None:
    """What ``model``'s decode products round activations to now (a name of
    :data:`qfserve.kernels.native.ACTIVATIONS`); None where no native kernel multiplies."""
    from qfserve.kernels.native import ACTIVATIONS

    kernel = kernel_of(model)
    if kernel is None:
        return None
    bits = kernel.activation_bits()
    return next(name for name, value in ACTIVATIONS.items() if value == bits)


def set_decode_activations(kernel: ModuleType | None, name: str) -> str:
    """Round decode steps' activations to ``name`` in the kernel's products (one setting for
    the process). Returns what is in effect: ``float32`` without a kernel or on a CPU with
    neither AVX-512 VNNI nor AVX2.

    Raises:
        ValueError: ``name`` is not one of :data:`qfserve.kernels.native.ACTIVATIONS`.
    """
    from qfserve.kernels.native import ACTIVATIONS

    if name not in ACTIVATIONS:
        raise ValueError(
            f"decode activations must be one of {', '.join(ACTIVATIONS)}, not {name!r}"
        )
    if kernel is None or not kernel.integer_activations:
        return "float32"
    kernel.activation_bits(ACTIVATIONS[name])
    return name


def _product(module: Any, x: mx.array) -> mx.array:
    """``x @ W.T`` on the module's codes through the native kernel (float32 ``x``)."""
    kernel: ModuleType = module._qfserve_kernel
    return cast(
        mx.array,
        kernel.quantized_matmul(
            x, module["weight"], module["scales"], module["biases"], module.bits
        ),
    )


class NativeQuantizedLinear(nn.QuantizedLinear):
    """An ``nn.QuantizedLinear`` whose float32 products run on the native kernel."""

    _qfserve_kernel: ModuleType

    def __call__(self, x: mx.array) -> mx.array:
        if x.dtype != mx.float32:
            return cast(mx.array, super().__call__(x))
        y = _product(self, x)
        return y + self["bias"] if "bias" in self else y


class NativeQuantizedEmbedding(nn.QuantizedEmbedding):
    """An ``nn.QuantizedEmbedding`` whose use as the tied output projection runs on the
    native kernel (the largest product of a small model's step: SmolLM2's is 49,152 x 576);
    looking tokens up dequantizes their rows only, as MLX's own class does, in float32."""

    _qfserve_kernel: ModuleType

    def __call__(self, ids: mx.array) -> mx.array:
        # MLX's class dequantizes in the scales' type: float16 rows would make the whole
        # model run in half precision on the CPU, off the kernel's path.
        return mx.dequantize(
            self["weight"][ids],
            self["scales"][ids].astype(mx.float32),
            self["biases"][ids].astype(mx.float32),
            group_size=self.group_size,
            bits=self.bits,
        )

    def as_linear(self, x: mx.array) -> mx.array:
        if x.dtype != mx.float32:
            return cast(mx.array, super().as_linear(x))
        return _product(self, x)


_NATIVE: dict[Any, type] = {
    nn.QuantizedLinear: NativeQuantizedLinear,
    nn.QuantizedEmbedding: NativeQuantizedEmbedding,
}
_PLAIN: dict[Any, type] = {native: plain for plain, native in _NATIVE.items()}


def _readable(module: Any) -> bool:
    return (
        getattr(module, "mode", "affine") == "affine"
        and module.bits in KERNEL_BITS
        and module.group_size in KERNEL_GROUPS
    )


def attach(model: nn.Module, kernel: ModuleType | None) -> int:
    """Give every quantized layer the kernel reads its native subclass (bfloat16 scales and
    biases widened to float32: the kernel reads float32 and float16), and install the
    kernel's attention and fused layers; without a kernel, :func:`densify` the model.

    Returns:
        How many layers read their codes through the kernel (0 without one).
    """
    _widen_halves(model)
    if kernel is None:
        n = densify(model)
        if n:
            logger.info("no native kernel: %d quantized layers dequantized to float32", n)
        return 0
    swapped = 0
    for _, module in model.named_modules():
        native = _NATIVE.get(type(module))
        if native is not None and _readable(module):
            if module["scales"].dtype not in (mx.float16, mx.float32):  # bfloat16
                for name in ("scales", "biases"):
                    module[name] = module[name].astype(mx.float32)
            object.__setattr__(module, "_qfserve_kernel", kernel)
            module.__class__ = native
        swapped += type(module) in _PLAIN  # attached now or before
    mx.eval(model.parameters())
    if swapped:  # the same kernel module attends (kv.attention), rotates, normalises, ...
        set_native(kernel)
        native_layers.install(model, kernel)
        fused.install(model, kernel)
    logger.info("%d quantized layers read their codes through the native kernel", swapped)
    return swapped


def detach(model: nn.Module) -> int:
    """Put back MLX's own quantized classes, MLX's attention and the layers
    :mod:`native_layers` swapped (before splitting the model over ranks, whose sharding
    rewrites the projections). Returns how many layers."""
    n = 0
    for _, module in model.named_modules():
        plain = _PLAIN.get(type(module))
        if plain is not None:
            module.__class__ = plain
            object.__delattr__(module, "_qfserve_kernel")
            n += 1
    set_native(None)
    fused.remove(model)
    native_layers.remove(model)
    return n


def densify(model: nn.Module) -> int:
    """Replace every quantized layer with a float32 one holding its dequantized weight (the
    CPU without the native kernel, and ranks of a sharded model). Returns how many."""
    dense: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding):
            continue
        weight = mx.dequantize(
            module["weight"],
            module["scales"].astype(mx.float32),
            module["biases"].astype(mx.float32),
            group_size=module.group_size,
            bits=module.bits,
            mode=getattr(module, "mode", "affine"),
        ).astype(mx.float32)
        if isinstance(module, nn.QuantizedEmbedding):
            plain: nn.Module = nn.Embedding(*weight.shape)
        else:
            plain = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in module)
            if "bias" in module:
                plain.bias = module["bias"].astype(mx.float32)
        plain.weight = weight
        mx.eval(plain.parameters())
        dense.append((name, plain))
    model.update_modules(_tree(dense))
    return len(dense)


def _widen_halves(model: nn.Module) -> None:
    """Float16 / bfloat16 matrices (an F16 GGUF tensor) in float32: MLX's CPU product is
    fast in float32 only."""
    for _, module in model.named_modules():
        if type(module) in (nn.Linear, nn.Embedding):
            for name in ("weight", "bias"):
                if name in module and module[name].dtype in (mx.float16, mx.bfloat16):
                    module[name] = module[name].astype(mx.float32)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters as held (codes, scales, biases and float tensors)."""
    from mlx.utils import tree_flatten

    leaves = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    return sum(v.nbytes for _, v in leaves)


def _tree(items: Sequence[tuple[str, nn.Module]]) -> dict[str, Any]:
    from mlx.utils import tree_unflatten

    return tree_unflatten(list(items)) if items else {}
