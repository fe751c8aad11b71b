"""A block's small ops through the native kernels on the CPU (:mod:`qfserve.kernels.native`):
RoPE, RMS normalisation, SwiGLU and Gemma's GELU MLP.

On MLX's CPU backend these are the slow part of a step once the products and attention are
fast: ``mx.fast.rope`` has no CPU kernel and runs a fallback of about twenty small ops (~115 us
a call, 60 calls in a decode step of SmolLM2-135M), ``mx.fast.rms_norm`` a fallback of several
(~60 us a row, ~1.3 ms for 512), and mlx-lm's compiled ``swiglu`` a scalar exp (~40 us for one
row, ~20 ms for a 512-token block: a third of a prefill chunk). :func:`install` swaps each
layer's plain ``nn.RoPE`` and ``nn.RMSNorm`` for :class:`NativeRoPE` and :class:`NativeRMSNorm`
(Gemma's ``1 + weight`` norm for :class:`NativeOffsetRMSNorm`), the ``swiglu`` its MLP calls
for the kernel's, and Gemma 3's MLP for one whose ``gelu_approx(gate) * up`` is the kernel's
``gelu_glu``: each the same arithmetic in one op (the GELU to float32 rounding), falling back
to MLX's own off the CPU or off float32. Other ropes (scaled, YaRN, Llama 3's), norms and
activations keep MLX's.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn

from qfserve.calibrations.model_info import attention_modules
from qfserve.engine.kv.evict import int32

_MARK = "_qfserve_native"


def _native(x: mx.array) -> bool:
    return x.dtype == mx.float32 and mx.default_device() == mx.cpu


class NativeRoPE(nn.Module):
    """A plain ``nn.RoPE`` (``plain``) whose float32 CPU calls go to the native kernel."""

    def __init__(self, plain: nn.RoPE, kernel: ModuleType) -> None:
        super().__init__()
        self.plain = plain
        self._kernel = kernel
        half = plain.dims // 2
        # The fallback's frequencies, computed as it computes them (exp of a float32 ramp).
        step = mx.array(math.log(plain.base) / half, dtype=mx.float32)
        self._inv_freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * step)
        mx.eval(self._inv_freqs)

    @property
    def kernel(self) -> ModuleType:
        return self._kernel

    @property
    def inv_freqs(self) -> mx.array:
        return self._inv_freqs

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if not _native(x) or x.ndim != 4:
            return cast(mx.array, self.plain(x, offset=offset))
        p = self.plain
        return cast(
            mx.array,
            self._kernel.rope(
                x,
                self._inv_freqs,
                offset_array(offset),
                p.dims,
                traditional=p.traditional,
                scale=p.scale,
            ),
        )


def offset_array(offset: Any) -> mx.array:
    """A cache's ``offset`` (an int, or one per sequence) as the native rope takes it."""
    if not isinstance(offset, mx.array):
        return int32(offset)  # one array per value: a step's layers share it
    return offset if offset.dtype == mx.int32 else offset.astype(mx.int32)


class NativeRMSNorm(nn.Module):
    """A plain ``nn.RMSNorm`` (``plain``, its weight) whose float32 CPU calls go to the
    native kernel."""

    def __init__(self, plain: nn.RMSNorm, kernel: ModuleType) -> None:
        super().__init__()
        self.plain = plain
        self._kernel = kernel

    @property
    def weight(self) -> mx.array:
        return cast(mx.array, self.plain.weight)

    def __call__(self, x: mx.array) -> mx.array:
        weight = self.plain.weight
        if not _native(x) or weight.dtype != mx.float32:
            return cast(mx.array, self.plain(x))
        return cast(mx.array, self._kernel.rms_norm(x, weight, self.plain.eps))


class NativeOffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm, whose scale is ``1 + weight`` (``plain``), through the native kernel:
    the scale added once here rather than at every call."""

    def __init__(self, plain: nn.Module, kernel: ModuleType) -> None:
        super().__init__()
        self.plain = plain
        self._kernel = kernel
        self._scale = 1.0 + plain.weight
        mx.eval(self._scale)

    @property
    def scale(self) -> mx.array:
        """``1 + weight``, what the norm scales by."""
        return self._scale

    def __call__(self, x: mx.array) -> mx.array:
        if not _native(x) or self._scale.dtype != mx.float32:
            return cast(mx.array, self.plain(x))
        return cast(mx.array, self._kernel.rms_norm(x, self._scale, self.plain.eps))


def _offset_norms() -> tuple[type, ...]:
    """The norm classes that scale by ``1 + weight`` (mlx-lm's Gemma 3)."""
    from mlx_lm.models import gemma3_text

    return (gemma3_text.RMSNorm,)


class _NativeGeluMLP:
    """Gemma 3's MLP, ``down(gelu_approx(gate(x)) * up(x))``, its activation in one native op
    on float32 CPU rows (MLX's compiled ``gelu_approx`` takes a scalar tanh per element); the
    class's own forward elsewhere."""

    _qfserve_gelu_kernel: ModuleType

    def __call__(self, x: mx.array) -> mx.array:
        mlp = cast(Any, self)
        if not _native(x):
            return cast(mx.array, super().__call__(x))  # type: ignore[misc]
        gate, up = mlp.gate_proj(x), mlp.up_proj(x)
        if not (_native(gate) and up.dtype == mx.float32 and gate.shape == up.shape):
            return cast(mx.array, mlp.down_proj(nn.gelu_approx(gate) * up))
        return cast(mx.array, mlp.down_proj(self._qfserve_gelu_kernel.gelu_glu(gate, up)))


_GELU_MLPS: dict[type, type] = {}


def _gelu_mlp_classes() -> dict[type, type]:
    """mlx-lm's Gemma 3 MLP class -> its subclass with the native activation."""
    if not _GELU_MLPS:
        from mlx_lm.models import gemma3_text

        base = gemma3_text.MLP
        body = {"__module__": base.__module__, "_qfserve_base": base}
        _GELU_MLPS[base] = type(f"Native{base.__name__}", (_NativeGeluMLP, base), body)
    return _GELU_MLPS


def _swiglu(kernel: ModuleType, original: Callable[..., mx.array]) -> Callable[..., mx.array]:
    def swiglu(gate: mx.array, x: mx.array) -> mx.array:
        if _native(gate) and x.dtype == mx.float32 and gate.shape == x.shape:
            return cast(mx.array, kernel.swiglu(gate, x))
        return original(gate, x)

    setattr(swiglu, _MARK, original)
    return swiglu


def swiglu_is_native(module: ModuleType) -> bool:
    """Whether ``module``'s ``swiglu`` is the native one :func:`install` put there."""
    return hasattr(getattr(module, "swiglu", None), _MARK)


def _rope_holder(attn: nn.Module) -> tuple[Any, str]:
    """Where a layer's own rope sits: ``attn.rope``, or inside a query tap wrapping it."""
    rope = getattr(attn, "rope", None)
    inner = getattr(rope, "inner", None)
    return (rope, "inner") if isinstance(inner, nn.Module) else (attn, "rope")


def install(model: nn.Module, kernel: ModuleType) -> int:
    """Swap every plain ``nn.RoPE`` and ``nn.RMSNorm`` of ``model`` for the native ones, and
    the ``swiglu`` of its MLPs' modules; returns how many modules and functions."""
    swapped = 0
    for attn in attention_modules(model):
        holder, name = _rope_holder(attn)
        rope = getattr(holder, name, None)
        if type(rope) is nn.RoPE:  # exactly: subclasses compute other frequencies
            setattr(holder, name, NativeRoPE(rope, kernel))
            swapped += 1
    modules = model.named_modules()
    natives = (NativeRMSNorm, NativeOffsetRMSNorm)
    inside = {id(m.plain) for _, m in modules if isinstance(m, natives)}  # installed
    offset = _offset_norms()
    norms = [
        (n, NativeRMSNorm(m, kernel) if type(m) is nn.RMSNorm else NativeOffsetRMSNorm(m, kernel))
        for n, m in modules
        if (type(m) is nn.RMSNorm or type(m) in offset) and id(m) not in inside
    ]
    if norms:
        from mlx.utils import tree_unflatten

        model.update_modules(tree_unflatten(norms))
        swapped += len(norms)
    for module in _mlp_modules(model):
        original = getattr(module, "swiglu", None)
        if callable(original) and not hasattr(original, _MARK):
            module.swiglu = _swiglu(kernel, original)  # type: ignore[attr-defined]
            swapped += 1
    gelu = _gelu_mlp_classes()
    for layer in getattr(model, "layers", []):
        mlp = getattr(layer, "mlp", None)
        if type(mlp) in gelu:  # exactly mlx-lm's class
            object.__setattr__(mlp, "_qfserve_gelu_kernel", kernel)
            mlp.__class__ = gelu[type(mlp)]
            swapped += 1
    return swapped


def remove(model: nn.Module) -> int:
    """Put back what :func:`install` swapped; returns how many."""
    restored = 0
    for attn in attention_modules(model):
        holder, name = _rope_holder(attn)
        rope = getattr(holder, name, None)
        if isinstance(rope, NativeRoPE):
            setattr(holder, name, rope.plain)
            restored += 1
    natives = (NativeRMSNorm, NativeOffsetRMSNorm)
    norms = [(n, m.plain) for n, m in model.named_modules() if isinstance(m, natives)]
    if norms:
        from mlx.utils import tree_unflatten

        model.update_modules(tree_unflatten(norms))
        restored += len(norms)
    for module in _mlp_modules(model):
        original = getattr(getattr(module, "swiglu", None), _MARK, None)
        if original is not None:
            module.swiglu = original  # type: ignore[attr-defined]
            restored += 1
    for layer in getattr(model, "layers", []):
        mlp = getattr(layer, "mlp", None)
        if isinstance(mlp, _NativeGeluMLP):
            mlp.__class__ = type(mlp)._qfserve_base  # type: ignore[attr-defined]
            restored += 1
    return restored


def _mlp_modules(model: nn.Module) -> list[ModuleType]:
    """The Python modules that define ``model``'s MLP blocks (they call ``swiglu`` by name)."""
    names = {
        type(layer.mlp).__module__
        for layer in getattr(model, "layers", [])
        if hasattr(layer, "mlp")
    }
    return [sys.modules[n] for n in sorted(names) if n in sys.modules]
