"""Every native entry point refuses what it cannot read: starting from a valid call, one
array argument at a time is given another dtype, a dimension more or less, a size off by one,
zero or doubled, or a non-contiguous layout, and the call must either compute or raise a
Python error, never crash or read out of bounds (``tests/kernels/sanitized.sh`` runs this
under AddressSanitizer, where an out-of-bounds read is a report, not silence)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.kernels.test_native_evict import _state

DTYPES = (mx.float32, mx.float16, mx.int32, mx.uint32, mx.bool_, mx.int8)


def valid_calls(kernel) -> dict:
    """Per entry point: (the function, its array arguments, its other arguments)."""
    rng = np.random.default_rng(0)

    def a(*shape, dtype=np.float32):
        return mx.array(rng.standard_normal(shape).astype(dtype))

    W = a(32, 64)
    w, scales, biases = mx.quantize(W, group_size=32, bits=4)
    codes = [w, scales.astype(mx.float32), biases.astype(mx.float32)]
    inv_freqs = mx.array(1.0 / 10000 ** (np.arange(8) / 8), dtype=mx.float32)
    keys, values, sc, order, free, row = _state(rng, 1, 2, 12, 16, ties=False)
    evict_arrays = [keys, values, sc, order, free, *row]
    evict_arrays += [mx.array(20, dtype=mx.int32), mx.array(15, dtype=mx.int32)]
    evict_arrays += [mx.array(2, dtype=mx.int32)]
    qkv = [list(mx.quantize(a(n, 64), group_size=32, bits=4)) for n in (64, 32, 32)]
    qkv = [[c[0], c[1].astype(mx.float32), c[2].astype(mx.float32)] for c in qkv]
    tail = [
        list(mx.quantize(a(*s), group_size=32, bits=4))
        for s in ((64, 64), (96, 64), (96, 64), (64, 96))
    ]
    tail = [[c[0], c[1].astype(mx.float32), c[2].astype(mx.float32)] for c in tail]
    return {
        "quantized_matmul": (kernel.quantized_matmul, [a(3, 64), *codes], (4,), {}),
        "dequantize": (kernel.dequantize, codes, (4,), {}),
        "decode_attention": (
            kernel.decode_attention,
            [a(1, 4, 1, 16), a(1, 2, 9, 16), a(1, 2, 9, 16)],
            (0.25,),
            {},
        ),
        "prefill_attention": (
            kernel.prefill_attention,
            [a(1, 4, 3, 16), a(1, 2, 9, 16), a(1, 2, 9, 16)],
            (0.25,),
            {},
        ),
        "rope": (kernel.rope, [a(1, 2, 3, 16), inv_freqs, mx.array(5, dtype=mx.int32)], (16,), {}),
        "rms_norm": (kernel.rms_norm, [a(2, 16), a(16)], (1e-6,), {}),
        "swiglu": (kernel.swiglu, [a(2, 16), a(2, 16)], (), {}),
        "gelu_glu": (kernel.gelu_glu, [a(2, 16), a(2, 16)], (), {}),
        "log_softmax": (kernel.log_softmax, [a(2, 37)], (), {}),
        "evict_step": (kernel.evict_step, evict_arrays, (), {}),
        "decode_qkv": (
            lambda x, *rest: kernel.decode_qkv(
                x, rest[0:3], rest[3:6], rest[6:9], rest[9], rest[10], 4, 2, 16
            ),
            [a(1, 1, 64), *qkv[0], *qkv[1], *qkv[2], inv_freqs, mx.array(3, dtype=mx.int32)],
            (),
            {},
        ),
        "decode_tail": (
            lambda at, x, *r: kernel.decode_tail(
                at, x, r[0:3], r[3], 1e-6, r[4:7], r[7:10], r[10:13]
            ),
            [a(1, 4, 1, 16), a(1, 1, 64), *tail[0], a(64), *tail[1], *tail[2], *tail[3]],
            (),
            {},
        ),
        "decode_qkv_head_norms": (  # Gemma 3's and Qwen3's
            lambda x, *rest: kernel.decode_qkv(
                x,
                rest[0:3],
                rest[3:6],
                rest[6:9],
                rest[9],
                rest[10],
                4,
                2,
                16,
                norm=rest[11],
                head_norms=list(rest[12:14]),
            ),
            [
                a(1, 1, 64),
                *qkv[0],
                *qkv[1],
                *qkv[2],
                inv_freqs,
                mx.array(3, dtype=mx.int32),
                a(64),
                a(16),
                a(16),
            ],
            (),
            {},
        ),
        "decode_tail_post_norms": (  # Gemma 3's
            lambda at, x, *r: kernel.decode_tail(
                at,
                x,
                r[0:3],
                r[3],
                1e-6,
                r[4:7],
                r[7:10],
                r[10:13],
                post_attention=r[13],
                post_feedforward=r[14],
                activation="gelu_approx",
            ),
            [
                a(1, 4, 1, 16),
                a(1, 1, 64),
                *tail[0],
                a(64),
                *tail[1],
                *tail[2],
                *tail[3],
                a(64),
                a(64),
            ],
            (),
            {},
        ),
    }


def mutate(x: mx.array, how: str, size_change: str, dtype: mx.Dtype, axis: int) -> mx.array:
    if how == "dtype":
        return x.astype(dtype)
    if how == "rank_up":
        return x[None]
    if how == "rank_down":
        return x.reshape(-1) if x.ndim > 1 else x.reshape(1, *x.shape)
    if how == "strided" and x.ndim >= 2:
        return mx.swapaxes(x, -1, -2)
    if x.ndim == 0:
        return x.reshape(1)
    axis %= x.ndim
    n = x.shape[axis]
    new = {"minus": max(0, n - 1), "plus": n + 1, "zero": 0, "double": 2 * n}[size_change]
    if new <= n:
        return mx.take(x, mx.arange(new), axis=axis)
    reps = [1] * x.ndim
    reps[axis] = 2
    return mx.take(mx.tile(x, reps), mx.arange(new), axis=axis)


@pytest.fixture(scope="module")
def calls(kernel):
    return valid_calls(kernel)


def test_the_valid_calls_compute(calls):
    """The starting points are valid: each computes (so a refusal below is the mutation's)."""
    for fn, arrays, args, kwargs in calls.values():
        out = fn(*arrays, *args, **kwargs)
        mx.eval(out)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    data=st.data(),
    how=st.sampled_from(["dtype", "rank_up", "rank_down", "strided", "size"]),
    size_change=st.sampled_from(["minus", "plus", "zero", "double"]),
    dtype=st.sampled_from(DTYPES),
    axis=st.integers(-4, 3),
)
def test_one_wrong_argument_is_refused_or_computed_never_a_crash(
    calls, data, how, size_change, dtype, axis
):
    name = data.draw(st.sampled_from(sorted(calls)))
    fn, arrays, args, kwargs = calls[name]
    i = data.draw(st.integers(0, len(arrays) - 1))
    changed = list(arrays)
    changed[i] = mutate(arrays[i], how, size_change, dtype, axis)
    try:
        out = fn(*changed, *args, **kwargs)
        mx.eval(out)
    except (ValueError, TypeError, RuntimeError, IndexError):
        pass  # refused, in a Python error
