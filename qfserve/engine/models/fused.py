"""A decode step's attention projections and MLP as one native op each.

On MLX's CPU backend every op costs microseconds of dispatch whatever its size, and a decode
step of a small model is mostly small ops: SmolLM2-135M's made ~800, two thirds of them in
the layers' projections, the reshapes to heads, the rotations and the MLP. The native
``decode_qkv`` (three products on the codes, then RoPE) and ``decode_mlp``
(``down(swiglu(gate(x), up(x)))``) each run the single ops' own routines in one dispatch, so
their results are the single ops' bit for bit (``qfserve/kernels/native/decode_block.cpp``).

:func:`install` gives the layers of a known forward a subclass that takes that path: mlx-lm's
llama ``Attention`` and ``MLP`` (Llama, SmolLM2, Mistral and the other models mlx-lm builds from
them), exactly those classes, whose forward is these steps and nothing else. A layer takes it
for decode rows only (``(B, 1, K)`` float32 on the CPU, as few sequences as the codes take),
when its projections read codes and have no bias, its rope is the native one and, for the MLP,
its module's ``swiglu`` is the native one. Anything else (a prompt block, a query tap that
self-calibration or capture puts in place of the rope, other dtypes) runs the class's own
forward, unchanged.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from qfserve.engine.models import native_layers
from qfserve.engine.models.native_layers import NativeRoPE, offset_array


def _codes(linear: Any, x: mx.array) -> list[mx.array] | None:
    """A projection's codes (w, scales, biases) where it has no bias and would read them for
    ``x`` (a :class:`qfserve.engine.models.quantized.DecodeLinear`: float32, few rows)."""
    codes, dense = getattr(linear, "codes", None), getattr(linear, "dense", None)
    if codes is None or dense is None or "bias" in dense or not codes.takes(x):
        return None
    return [codes.weight, codes.scales, codes.biases]


def _decode_row(x: mx.array) -> bool:
    return x.ndim == 3 and x.shape[1] == 1 and mx.default_device() == mx.cpu


class _FusedAttention:
    """The fused path of an attention layer, before its class's own forward."""

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        attn = cast(Any, self)
        rope = attn.rope
        qkv = [_codes(p, x) for p in (attn.q_proj, attn.k_proj, attn.v_proj)]
        if cache is None or not _decode_row(x) or type(rope) is not NativeRoPE or None in qkv:
            return cast(mx.array, super().__call__(x, mask, cache))  # type: ignore[misc]
        plain = rope.plain
        q, k, v = rope.kernel.decode_qkv(
            x, *qkv, rope.inv_freqs, offset_array(cache.offset), attn.n_heads,
            attn.n_kv_heads, plain.dims, traditional=plain.traditional, scale=plain.scale,
        )  # fmt: skip
        keys, values = cache.update_and_fetch(k, v)
        # Looked up at each call: the attention hook (qfserve.engine.kv.attention) wraps it.
        sdpa = sys.modules[type(self).__module__].scaled_dot_product_attention
        out = sdpa(q, keys, values, cache=cache, scale=attn.scale, mask=mask)
        # One row: (B, H, 1, D) in memory is (B, 1, H * D), the transpose a no-op.
        return cast(mx.array, attn.o_proj(out.reshape(x.shape[0], 1, -1)))


class _FusedMLP:
    """The fused path of an MLP, before its class's own forward."""

    kernel: ModuleType

    def __call__(self, x: mx.array) -> mx.array:
        mlp = cast(Any, self)
        # Its hidden rows are as many as x's: x stands for them in takes().
        parts = [_codes(p, x) for p in (mlp.gate_proj, mlp.up_proj, mlp.down_proj)]
        native = native_layers.swiglu_is_native(sys.modules[type(self).__module__])
        if not _decode_row(x) or None in parts or not native:
            return cast(mx.array, super().__call__(x))  # type: ignore[misc]
        return cast(mx.array, self.kernel.decode_mlp(x, *parts))


# Each known class, its fused subclass per kernel module (defined in the class's own module,
# whose scaled_dot_product_attention and swiglu the fused path then looks up).
_KNOWN: dict[type, type] = {llama.Attention: _FusedAttention, llama.MLP: _FusedMLP}
_MADE: dict[tuple[type, int], type] = {}


def _fused_class(base: type, kernel: ModuleType) -> type:
    key = (base, id(kernel))
    if key not in _MADE:
        body = {"__module__": base.__module__, "kernel": kernel, "_qfserve_base": base}
        _MADE[key] = type(f"Fused{base.__name__}", (_KNOWN[base], base), body)
    return _MADE[key]


def _blocks(model: nn.Module) -> list[nn.Module]:
    layers = getattr(model, "layers", [])
    return [m for layer in layers for m in (getattr(layer, "self_attn", None),
                                             getattr(layer, "mlp", None)) if m is not None]  # fmt: skip


def install(model: nn.Module, kernel: ModuleType) -> int:
    """Give every attention and MLP block of a known class its fused subclass; returns how
    many."""
    swapped = 0
    for block in _blocks(model):
        if type(block) in _KNOWN:
            block.__class__ = _fused_class(type(block), kernel)
            swapped += 1
    return swapped


def remove(model: nn.Module) -> int:
    """Put back the classes :func:`install` replaced; returns how many."""
    restored = 0
    for block in _blocks(model):
        base = getattr(type(block), "_qfserve_base", None)
        if base is not None:
            block.__class__ = base
            restored += 1
    return restored
