"""A decode step's transformer block as two native ops around its cache and attention.

On MLX's CPU backend every op costs microseconds of dispatch whatever its size, and a decode
step of a small model is mostly small ops: SmolLM2-135M's made ~800 (per layer two norms,
four projections, six reshapes and transposes, two rotations and two residual adds, then an
MLP of four), while the Python that builds the next step's graph competes for the same cores.
The native ``decode_qkv`` (norm, the q/k/v products on the codes, RoPE) and ``decode_tail``
(``o`` and the residual, norm, MLP and residual) each run the single ops' own routines in one
dispatch, so the block's output is the single ops' bit for bit
(``qfserve/kernels/native/decode_block.cpp``). Gemma 3 270M's step took ~30 ms op by op, of
which its products are ~21.

:func:`install` gives each block of a known forward a subclass that takes that path, exactly
these classes of mlx-lm's:

- llama's ``TransformerBlock`` (Llama, SmolLM2, Mistral and the other models mlx-lm builds
  from it): ``h = x + attn(norm(x)); h + mlp(norm(h))``, a SwiGLU MLP;
- Qwen3's: the same, with q and k normalised per head before RoPE;
- Gemma 3's: q and k normalised per head too, ``h = x + norm(attn(norm(x))); h +
  norm(mlp(norm(h)))`` (post-attention and post-feed-forward norms), every norm scaling by
  ``1 + w``, and a ``gelu_approx(gate) * up`` MLP, the kernel's ``gelu_glu`` in both paths
  (:mod:`qfserve.engine.models.native_layers`).

It is installed where every projection reads codes and has no bias, every norm (with one eps
for them all), the rope and a SwiGLU's ``swiglu`` are the native ones; what it reads
is taken at install (:func:`qfserve.engine.models.quantized.attach` installs it, ``detach``
removes it; installing again after a block's weights change reads them anew, Gemma's norms
as their native modules hold ``1 + w``). A block takes
the path for decode rows only (``(B, 1, K)`` float32 on the CPU, at most :data:`MAX_ROWS`
sequences); a prompt block runs the class's own forward, unchanged. A query tap on the rope
(self-calibration, traffic sampling, capture: :class:`~qfserve.calibrations.capture.QueryRoPE`)
keeps the path: it is handed the queries the native op rotated, before the keys are stored,
as the rope's own call would have handed them. Without that, a model with no calibration
artifact (which samples its traffic by default) would decode every step op by op.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama

from qfserve.calibrations.capture import QueryRoPE
from qfserve.calibrations.kvzap.hidden import HIDDEN_TAP
from qfserve.engine.models import native_layers
from qfserve.engine.models.native_layers import (
    NativeOffsetRMSNorm,
    NativeRMSNorm,
    NativeRoPE,
    offset_array,
)

# Sequences a fused decode step takes: the rows the kernel multiplies in registers
# (``kFewRows`` in ``quantized_matmul.cpp``); more would take its prompt path anyway.
MAX_ROWS = 32


@dataclass(frozen=True)
class _Family:
    """Where a known block class keeps what the fused ops compute, beside Llama's layout."""

    mlp_norm: str  # the norm before the MLP
    post_norms: tuple[str, str] | None  # norms of attention's and the MLP's outputs (Gemma 3)
    head_norms: bool  # q and k normalised per head before RoPE (Gemma 3, Qwen3)
    activation: str  # of the MLP: "swiglu" (the module's, native) or "gelu_approx"


def _families() -> dict[type, _Family]:
    from mlx_lm.models import gemma3_text, qwen3

    llama_like = _Family("post_attention_layernorm", None, False, "swiglu")
    return {
        llama.TransformerBlock: llama_like,
        qwen3.TransformerBlock: replace(llama_like, head_norms=True),
        gemma3_text.TransformerBlock: _Family(
            "pre_feedforward_layernorm",
            ("post_attention_layernorm", "post_feedforward_layernorm"),
            True,
            "gelu_approx",
        ),
    }


@dataclass(frozen=True)
class _Parts:
    """What a fused block reads, taken from its modules at install."""

    kernel: ModuleType
    rope: NativeRoPE
    qkv: tuple[list[mx.array], list[mx.array], list[mx.array]]
    tail: tuple[list[mx.array], list[mx.array], list[mx.array], list[mx.array]]  # o, MLP
    norms: tuple[mx.array, mx.array]  # the input's and the MLP's
    eps: float  # of every norm
    heads: tuple[int, int]
    scale: float
    attention: ModuleType  # the module whose scaled_dot_product_attention the class calls
    head_norms: list[mx.array]  # q's and k's, or none
    post_norms: tuple[mx.array | None, mx.array | None]
    activation: str


def _codes(linear: Any) -> list[mx.array] | None:
    """A projection's codes (w, scales, biases) where the kernel reads them and it has no
    bias."""
    if getattr(linear, "_qfserve_kernel", None) is None or "bias" in linear:
        return None
    return [linear["weight"], linear["scales"], linear["biases"]]


def _norm(module: Any) -> tuple[mx.array, float] | None:
    """The weight the native norm scales by (Gemma's ``1 + w``, as its module computes it once)
    and eps, where ``module`` is one of the native norms."""
    kind = getattr(type(module), "_qfserve_untapped", type(module))  # a KVzap tap: the same norm
    if kind is NativeRMSNorm:
        weight = module.weight
    elif kind is NativeOffsetRMSNorm:
        weight = module.scale
    else:
        return None
    return (weight, float(module.plain.eps)) if weight.dtype == mx.float32 else None


def _parts(block: Any, kernel: ModuleType, family: _Family) -> _Parts | None:
    """A block's parts, or ``None`` where one of them is not what the fused path computes."""
    attn, mlp = block.self_attn, block.mlp
    # The rope itself where a query tap wraps it (installed again while self-calibrating).
    rope = attn.rope.inner if isinstance(attn.rope, QueryRoPE) else attn.rope
    projections = [_codes(getattr(attn, f"{p}_proj")) for p in "qkvo"]
    projections += [_codes(getattr(mlp, f"{p}_proj")) for p in ("gate", "up", "down")]
    names = ["input_layernorm", family.mlp_norm, *(family.post_norms or ())]
    norms = [_norm(getattr(block, n)) for n in names]
    if family.head_norms:
        norms += [_norm(attn.q_norm), _norm(attn.k_norm)]
    module = sys.modules[type(block).__module__]
    if (
        any(p is None for p in projections)
        or None in norms
        or type(rope) is not NativeRoPE
        or (family.activation == "swiglu" and not native_layers.swiglu_is_native(module))
    ):
        return None
    weights = [w for w, _ in cast(list[tuple[mx.array, float]], norms)]
    eps = {e for _, e in cast(list[tuple[mx.array, float]], norms)}
    if len(eps) != 1:  # the ops take one eps for every norm
        return None
    q, k, v, o, gate, up, down = cast(list[list[mx.array]], projections)
    post = weights[2:4] if family.post_norms else [None, None]
    return _Parts(
        kernel,
        rope,
        (q, k, v),
        (o, gate, up, down),
        (weights[0], weights[1]),
        eps.pop(),
        (attn.n_heads, attn.n_kv_heads),
        attn.scale,
        module,
        weights[-2:] if family.head_norms else [],
        (post[0], post[1]),
        family.activation,
    )


class _FusedBlock:
    """The fused path of a transformer block, before its class's own forward."""

    _qfserve_parts: _Parts

    def __call__(self, x: mx.array, mask: Any = None, cache: Any = None) -> mx.array:
        p = self._qfserve_parts
        rope_now = cast(Any, self).self_attn.rope
        # A query tap (self-calibration, traffic sampling, capture) around the rope read here.
        tap = rope_now if isinstance(rope_now, QueryRoPE) and rope_now.inner is p.rope else None
        if (
            cache is None
            or x.ndim != 3
            or x.shape[1] != 1
            or x.dtype != mx.float32
            or x.shape[0] > MAX_ROWS
            or (rope_now is not p.rope and tap is None)  # another rope: as written
            or mx.default_device() != mx.cpu
        ):
            return cast(mx.array, super().__call__(x, mask, cache))  # type: ignore[misc]
        rope = p.rope.plain
        if (hidden := getattr(cast(Any, self).input_layernorm, HIDDEN_TAP, None)) is not None:
            # A KVzap scorer reads the norm's output for the row it scores: the tap keeps the
            # input and the norm, computed where it is read (the eviction step, or one op).
            hidden.defer(x, p.norms[0], p.eps)
        q, k, v = p.kernel.decode_qkv(
            x,
            *p.qkv,
            p.rope.inv_freqs,
            offset_array(cache.offset),
            *p.heads,
            rope.dims,
            traditional=rope.traditional,
            scale=rope.scale,
            norm=p.norms[0],
            eps=p.eps,
            head_norms=p.head_norms,
        )
        if tap is not None:  # a query tap sees the rotated queries before the keys are stored
            tap.rotated(q, cache.offset)
        keys, values = cache.update_and_fetch(k, v)
        # Looked up at each call: the attention hook (qfserve.engine.kv.attention) wraps it.
        out = p.attention.scaled_dot_product_attention(
            q, keys, values, cache=cache, scale=p.scale, mask=mask
        )
        o, gate, up, down = p.tail
        return cast(
            mx.array,
            p.kernel.decode_tail(
                out,
                x,
                o,
                p.norms[1],
                p.eps,
                gate,
                up,
                down,
                post_attention=p.post_norms[0],
                post_feedforward=p.post_norms[1],
                activation=p.activation,
            ),
        )


_MADE: dict[type, type] = {}


def _fused_class(base: type) -> type:
    if base not in _MADE:  # defined in the base's module, as mlx-lm's own classes are
        body = {"__module__": base.__module__, "_qfserve_base": base}
        _MADE[base] = type(f"Fused{base.__name__}", (_FusedBlock, base), body)
    return _MADE[base]


def install(model: nn.Module, kernel: ModuleType) -> int:
    """Give every block of a known class whose parts allow it the fused subclass, reading
    its parts now (again where it has it already: after its weights changed); returns how
    many have it."""
    swapped, families = 0, _families()
    for block in getattr(model, "layers", []):
        base = getattr(type(block), "_qfserve_base", type(block))
        if base not in families:
            continue
        parts = _parts(block, kernel, families[base])
        if parts is None:
            _unfuse(block)
            continue
        object.__setattr__(block, "_qfserve_parts", parts)
        block.__class__ = _fused_class(base)
        swapped += 1
    return swapped


def _unfuse(block: Any) -> bool:
    base = getattr(type(block), "_qfserve_base", None)
    if base is None:
        return False
    block.__class__ = base
    object.__delattr__(block, "_qfserve_parts")
    return True


def remove(model: nn.Module) -> int:
    """Put back the classes :func:`install` replaced; returns how many."""
    return sum(_unfuse(block) for block in getattr(model, "layers", []))
