"""The native quantized matmul against numpy: codes unpacked by hand from MLX's documented
layout (a little-endian bit stream of ``bits``-bit codes, ``w = scale * q + bias`` per group),
not by ``mx.dequantize``; few rows (in registers) and many (dequantized tiles through the
BLAS), every bit width and group size, odd shapes and extreme scales. Few rows take integer
activations (int16 by default, int8 on request) where the CPU has VNNI or AVX2: those are held to
numpy's own rounding of x per block, and the float path (``activation_bits(0)``) to float32
rounding."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from qfserve.kernels import native
from tests.kernels.conftest import activations


def unpack(
    w: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int, group: int = 32
) -> np.ndarray:
    """The dense float64 weight of MLX affine codes, in numpy."""
    stream = np.unpackbits(w.view(np.uint8), axis=1, bitorder="little")  # (N, K * bits)
    q = stream.reshape(w.shape[0], -1, bits) @ (1 << np.arange(bits))  # (N, K)
    groups = q.reshape(q.shape[0], -1, group).astype(np.float64)
    dense = groups * scales[..., None].astype(np.float64) + biases[..., None].astype(np.float64)
    return dense.reshape(q.shape)


def codes(rng: np.random.Generator, n: int, k: int, bits: int, group: int = 32, scale=0.05,
          dtype=np.float32):  # fmt: skip
    w = mx.array(rng.integers(0, 2**32, size=(n, k * bits // 32), dtype=np.uint32))
    scales = mx.array((rng.uniform(0.02, 1, size=(n, k // group)) * scale).astype(dtype))
    biases = mx.array((rng.uniform(-4, 4, size=(n, k // group)) * scale).astype(dtype))
    return w, scales, biases


def check(kernel, rng, *, bits, group, rows, n, k, scale=0.05, dtype=np.float32):
    w, scales, biases = codes(rng, n, k, bits, group, scale, dtype)
    x = mx.array(rng.standard_normal((rows, k), dtype=np.float32))
    with activations(kernel, 0):
        got = np.array(kernel.quantized_matmul(x, w, scales, biases, bits))
    dense = unpack(np.array(w), np.array(scales), np.array(biases), bits, group)
    want = np.array(x, dtype=np.float64) @ dense.T
    assert got.shape == (rows, n) and got.dtype == np.float32
    # float32 sums of k terms: relative to the sum of the terms' magnitudes.
    bound = np.abs(np.array(x, np.float64)) @ np.abs(dense).T
    assert np.all(np.abs(got - want) <= 2e-6 * np.sqrt(k) * bound + 1e-30)
    deq = np.array(kernel.dequantize(w, scales, biases, bits))
    np.testing.assert_allclose(deq, dense, rtol=1e-6, atol=1e-6 * np.abs(dense).max())


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("rows", [1, 3, 4, 9, 40])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (1000, 576), (4100, 160)])
def test_products_match_numpy(kernel, bits, rows, n, k):
    check(kernel, np.random.default_rng(rows * 1000 + n + bits), bits=bits, group=32,
          rows=rows, n=n, k=k)  # fmt: skip


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("group", [64, 128])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_mlx_group_sizes(kernel, bits, group, rows):
    """``mlx_lm.convert -q`` folders: groups of 64 and 128."""
    check(kernel, np.random.default_rng(group + rows + bits), bits=bits, group=group,
          rows=rows, n=130, k=384)  # fmt: skip


@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize("rows", [1, 6, 20])
def test_float16_scales_and_biases(kernel, bits, rows):
    """What the converted folders hold: float16 scales and biases, widened exactly."""
    check(kernel, np.random.default_rng(bits * rows), bits=bits, group=32, rows=rows, n=200,
          k=320, dtype=np.float16)  # fmt: skip
    check(
        kernel,
        np.random.default_rng(7),
        bits=bits,
        group=32,
        rows=rows,
        n=40,
        k=64,
        scale=1e-6,
        dtype=np.float16,
    )  # fmt: skip  (subnormal halves)


@pytest.mark.parametrize("activation", [0, 8, 16, 32])
def test_few_row_products_split_over_the_pool(kernel, activation):
    """A product large enough to be split over the kernels' pool (an output projection's
    shape), on float32 activations and on each integer setting: every thread reads the calling
    thread's staged x, so each of many calls equals its reference (x itself, or its rounding),
    whichever thread took which rows."""
    if activation and not kernel.integer_activations:
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2: products keep float32 activations")
    rng = np.random.default_rng(activation)
    w, scales, biases = codes(rng, 4096, 576, 8, 32)
    wn, sn, bn = np.array(w), np.array(scales), np.array(biases)
    dense = unpack(wn, sn, bn, 8, 32)
    for call in range(6):
        x = rng.standard_normal((1 + call % 3, 576)).astype(np.float32)
        with activations(kernel, activation):
            got = np.array(kernel.quantized_matmul(mx.array(x), w, scales, biases, 8))
        if activation:
            top = {8: 127, 16: 32767, 32: 2**30 - 2**16}[activation]
            want, _ = rounded_reference(x, wn, sn, bn, 8, 32, top)
        else:
            want = x.astype(np.float64) @ dense.T
        magnitude = np.abs(x.astype(np.float64)) @ np.abs(dense).T
        assert np.all(np.abs(got - want) <= 4e-6 * np.sqrt(576) * magnitude + 1e-30)


@pytest.mark.parametrize("scale", [1e-30, 1e25])
@pytest.mark.parametrize("rows", [2, 17])
def test_extreme_scales(kernel, scale, rows):
    check(kernel, np.random.default_rng(3), bits=5, group=32, rows=rows, n=64, k=96,
          scale=scale)  # fmt: skip


def test_matches_mlx_own_dequantize(kernel):
    """The same codes as MLX reads them (its own quantize, 6 bits, group 64)."""
    rng = np.random.default_rng(4)
    weight = mx.array(rng.standard_normal((48, 256), dtype=np.float32))
    w, scales, biases = mx.quantize(weight, group_size=64, bits=6)
    dense = mx.dequantize(w, scales, biases, group_size=64, bits=6)
    got = kernel.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), 6)
    np.testing.assert_allclose(np.array(got), np.array(dense), rtol=1e-5, atol=1e-5)


def test_strided_batched_inputs_and_compile(kernel):
    """Leading axes and any strides are read in place (a transposed and a sliced view), and
    the primitive runs inside mx.compile; a strided prompt too."""
    rng = np.random.default_rng(1)
    w, scales, biases = codes(rng, 256, 128, 4)
    dense = unpack(np.array(w), np.array(scales), np.array(biases), 4)
    base = mx.array(rng.standard_normal((3, 128, 5), dtype=np.float32))
    view = base.transpose(2, 0, 1)[1:4:2]  # (2, 3, 128): strided on every axis
    with activations(kernel, 0):
        got = np.array(kernel.quantized_matmul(view, w, scales, biases, 4))
    assert got.shape == (2, 3, 256)
    np.testing.assert_allclose(got, np.array(view, np.float64) @ dense.T, rtol=2e-5, atol=1e-4)
    x = mx.array(rng.standard_normal((128, 2), dtype=np.float32)).T  # (2, 128), not contiguous
    want = np.array(x, dtype=np.float64) @ dense.T
    compiled = mx.compile(lambda a: kernel.quantized_matmul(a, w, scales, biases, 4) * 2.0)
    with activations(kernel, 0):
        got = np.array(kernel.quantized_matmul(x, w, scales, biases, 4))
        twice = np.array(compiled(x))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=1e-4)
    np.testing.assert_allclose(twice, 2 * want, rtol=2e-5, atol=2e-4)
    many = mx.array(rng.standard_normal((128, 30), dtype=np.float32)).T  # (30, 128) strided
    with activations(kernel, 0):
        got = np.array(kernel.quantized_matmul(many, w, scales, biases, 4))
    np.testing.assert_allclose(
        got,
        np.array(many, np.float64) @ dense.T,
        rtol=2e-5,
        atol=1e-4,
    )


def rounded_reference(
    x: np.ndarray,
    w: np.ndarray,
    scales: np.ndarray,
    biases: np.ndarray,
    bits: int,
    group: int,
    top: int,
) -> tuple[np.ndarray, np.ndarray]:
    """numpy's own rounding of x to integers per block of 32 (float32 arithmetic: step
    max|x| / top, to nearest even) times the weight's scaled codes, plus the biases times x's
    exact sums, in float64; and the bound on its difference from the product on x itself
    (each element off by at most half its block's step, through the scaled codes only)."""
    blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(top) / np.where(amax > 0, amax, 1), np.float32(0))
    q = np.rint(blocks * inv)
    assert np.abs(q).max() <= top * (1 + 2.0**-22)  # float32's rounding of x * top / max
    step = (amax / np.float32(top)).astype(np.float64)
    rounded = (q.astype(np.float64) * step).reshape(x.shape)
    bias = np.repeat(biases.astype(np.float64), group, axis=1)
    scaled = unpack(w, scales, biases, bits, group) - bias
    half_steps = np.repeat(0.5 * step.reshape(x.shape[0], -1), 32, axis=1)
    return rounded @ scaled.T + x.astype(np.float64) @ bias.T, half_steps @ np.abs(scaled).T


@pytest.mark.parametrize(
    ("activation", "rows"),
    [(8, 1), (8, 3), (8, 8), (8, 13), (8, 32), (16, 1), (16, 3), (16, 4), (32, 1), (32, 3)],
)
@pytest.mark.parametrize("bits", [4, 5, 6, 8])
@pytest.mark.parametrize(("group", "k"), [(32, 128), (32, 160), (32, 576), (64, 192), (128, 384)])
def test_integer_activations_match_numpys_rounding(kernel, activation, rows, bits, group, k):
    """Decode steps' rows (int8: up to 32; int16: up to 4; int32: up to 3), x rounded per block
    of 32 (VNNI or AVX2):
    the product on numpy's rounding of x within float32 tolerance, and the product on x itself
    within the rounding's own bound. Odd block counts (160 and 192: a pair's second block
    missing) and float16 scales included."""
    if not kernel.integer_activations:
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2: products keep float32 activations")
    rng = np.random.default_rng(bits * 1000 + group + rows + k + activation)
    dtype = np.float16 if rows % 2 else np.float32
    w, scales, biases = codes(rng, 72, k, bits, group, dtype=dtype)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[:, 5] *= 40  # an outlier channel, as language models' hidden states have
    if rows > 2:
        x[2, :32] = 0  # a zero block
    with activations(kernel, activation):
        got = np.array(kernel.quantized_matmul(mx.array(x), w, scales, biases, bits))
    top = {8: 127, 16: 32767, 32: 2**30 - 2**16}[activation]
    w, scales, biases = np.array(w), np.array(scales), np.array(biases)
    want, rounding = rounded_reference(x, w, scales, biases, bits, group, top)
    dense = unpack(w, scales, biases, bits, group)
    magnitude = np.abs(x.astype(np.float64)) @ np.abs(dense).T
    assert np.all(np.abs(got - want) <= 4e-6 * np.sqrt(k) * magnitude + 1e-30)
    exact = x.astype(np.float64) @ dense.T
    assert np.all(np.abs(got - exact) <= rounding * (1 + 1e-4) + 4e-6 * np.sqrt(k) * magnitude)
    if activation == 8:
        assert np.abs(got - exact).max() > 1e-3  # it did round: the float path is far closer


@pytest.mark.parametrize("scale", [1e-30, 1e25])
@pytest.mark.parametrize(("activation", "within"), [(16, 1e-4), (32, 1e-6)])
def test_integer_activations_extreme_scales(kernel, scale, activation, within):
    """Weights' scales near float32's ends: the rounding stays relative to x alone."""
    if not kernel.integer_activations:
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX2")
    rng = np.random.default_rng(11)
    w, scales, biases = codes(rng, 64, 96, 5, scale=scale)
    x = rng.standard_normal((3, 96)).astype(np.float32)
    dense = unpack(np.array(w), np.array(scales), np.array(biases), 5)
    with activations(kernel, activation):
        got = np.array(kernel.quantized_matmul(mx.array(x), w, scales, biases, 5))
    want = x.astype(np.float64) @ dense.T
    bound = np.abs(x.astype(np.float64)) @ np.abs(dense).T
    assert np.all(np.abs(got - want) <= within * bound)


def test_activation_bits_switch_and_many_rows(kernel):
    """The setting is process-wide and read back; a bad value is refused; more than 32 rows
    (a prompt) never round x."""
    with pytest.raises(ValueError, match="0 .float32., 8, 16 or 32 bits, not 12"):
        kernel.activation_bits(12)
    if not kernel.integer_activations:
        assert kernel.activation_bits(16) == 0
        return
    rng = np.random.default_rng(9)
    w, scales, biases = codes(rng, 64, 96, 5)
    dense = unpack(np.array(w), np.array(scales), np.array(biases), 5)
    x = rng.standard_normal((40, 96)).astype(np.float32)
    with activations(kernel, 8):
        assert kernel.activation_bits() == 8
        got = np.array(kernel.quantized_matmul(mx.array(x), w, scales, biases, 5))
    bound = np.abs(x.astype(np.float64)) @ np.abs(dense).T
    assert np.all(np.abs(got - x.astype(np.float64) @ dense.T) <= 2e-6 * np.sqrt(96) * bound)
    with activations(kernel, 16):  # more than 4 rows: int16 leaves them to the float path
        sixteen = np.array(kernel.quantized_matmul(mx.array(x[:8]), w, scales, biases, 5))
    with activations(kernel, 32):  # more than 3 rows: so does int32
        wide = np.array(kernel.quantized_matmul(mx.array(x[:4]), w, scales, biases, 5))
    with activations(kernel, 0):
        assert kernel.activation_bits() == 0
        plain = np.array(kernel.quantized_matmul(mx.array(x[:8]), w, scales, biases, 5))
        plain_four = np.array(kernel.quantized_matmul(mx.array(x[:4]), w, scales, biases, 5))
    np.testing.assert_array_equal(sixteen, plain)
    np.testing.assert_array_equal(wide, plain_four)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bits": 3}, "bits is 3 but the codes are 4-bit"),
        ({"x": mx.zeros((1, 96))}, "width 96 must be 32, 64 or 128 times"),
        ({"x": mx.zeros((1, 64), dtype=mx.float16)}, "must be float32"),
        ({"scales": mx.zeros((32, 3))}, "both float32 or both float16"),
        ({"scales": mx.zeros((32, 2), dtype=mx.float16)}, "both float32 or both float16"),
        ({"scales": mx.zeros((32, 3)), "biases": mx.zeros((32, 3))}, "must be 32, 64 or 128"),
        ({"w": mx.zeros((32, 10), dtype=mx.uint32)}, "bits is 4 but the codes are 5-bit"),
        ({"w": mx.zeros((32, 14), dtype=mx.uint32)}, "codes of 4, 5, 6 or 8 bits"),
    ],
)
def test_bad_arguments_are_refused(kernel, change, message):
    w, scales, biases = codes(np.random.default_rng(2), 32, 64, 4)
    args = {"x": mx.zeros((1, 64)), "w": w, "scales": scales, "biases": biases, "bits": 4}
    with pytest.raises(ValueError, match=message):
        kernel.quantized_matmul(**{**args, **change})


def test_off_switch_and_unbuildable_fall_back(monkeypatch, tmp_path):
    """``QFSERVE_NATIVE=off`` and a machine without CMake both give ``None`` (callers keep
    float32), the latter with the reason logged."""
    monkeypatch.setenv("QFSERVE_NATIVE", "off")
    assert native.load(tmp_path / "a") is None
    monkeypatch.setenv("QFSERVE_NATIVE", "auto")
    monkeypatch.setattr(native.shutil, "which", lambda name: None)
    monkeypatch.setattr(native, "_pip_cmake", lambda: None)
    assert native.load(tmp_path / "b") is None
    assert not list(Path(tmp_path / "b").glob("*/*.so"))


def attention_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Softmax attention in float64, each query head against its KV head's keys."""
    group = q.shape[1] // k.shape[1]
    k64, v64 = np.repeat(k, group, axis=1).astype(np.float64), np.repeat(v, group, axis=1)
    logits = np.einsum("bhqd,bhsd->bhqs", q.astype(np.float64), k64) * scale
    weights = np.exp(logits - logits.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return np.einsum("bhqs,bhsd->bhqd", weights, v64.astype(np.float64))


@pytest.mark.parametrize("rows", [1, 7, 300, 4100])
@pytest.mark.parametrize(
    ("batch", "q_heads", "kv_heads", "dims"),
    # SmolLM2's, a plain loop's, Gemma 3's, 128 in groups of 2 and of 4 (the plain loop again)
    [(1, 9, 3, 64), (2, 4, 4, 40), (1, 4, 1, 256), (2, 4, 2, 128), (1, 8, 2, 128)],
)
def test_decode_attention_matches_numpy(kernel, rows, batch, q_heads, kv_heads, dims):
    rng = np.random.default_rng(rows + q_heads)
    q = rng.standard_normal((batch, q_heads, 1, dims), dtype=np.float32)
    # Keys and values as a cache holds them: the first `rows` of a larger buffer (strided).
    k_buf = rng.standard_normal((batch, kv_heads, rows + 5, dims), dtype=np.float32) * 2
    v_buf = rng.standard_normal((batch, kv_heads, rows + 5, dims), dtype=np.float32)
    k, v = mx.array(k_buf)[:, :, :rows], mx.array(v_buf)[:, :, :rows]
    got = np.array(kernel.decode_attention(mx.array(q), k, v, 0.125))
    want = attention_reference(q, k_buf[:, :, :rows], v_buf[:, :, :rows], 0.125)
    assert got.shape == (batch, q_heads, 1, dims)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("shapes", "message"),
    [
        (((1, 9, 2, 64), (1, 3, 5, 64), (1, 3, 5, 64)), "one query a head"),
        (((1, 8, 1, 64), (1, 3, 5, 64), (1, 3, 5, 64)), "do not match"),
        (((1, 9, 1, 64), (1, 3, 5, 32), (1, 3, 5, 64)), "do not match"),
        (((1, 9, 1, 64), (1, 3, 0, 64), (1, 3, 0, 64)), "do not match"),
    ],
)
def test_decode_attention_refuses_bad_shapes(kernel, shapes, message):
    q, k, v = (mx.zeros(s) for s in shapes)
    with pytest.raises(ValueError, match=message):
        kernel.decode_attention(q, k, v, 1.0)


def assert_held_rows_attended(got, q, k, v, held: np.ndarray, scale: float) -> None:
    """Each (sequence, KV head)'s query heads in ``got`` attended its first ``held`` rows
    alone (the numpy reference), or are zeros where it holds none."""
    B, kv_heads = held.shape
    group = q.shape[1] // kv_heads
    for b in range(B):
        for h in range(kv_heads):
            n, heads = held[b, h], slice(group * h, group * (h + 1))
            if n == 0:
                np.testing.assert_array_equal(got[b, heads], 0.0)
                continue
            want = attention_reference(
                q[b : b + 1, heads], k[b : b + 1, h : h + 1, :n], v[b : b + 1, h : h + 1, :n], scale
            )
            np.testing.assert_allclose(got[b, heads], want[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("q_heads", "kv_heads", "dims"), [(9, 3, 64), (4, 2, 128), (4, 1, 256)])
def test_decode_attention_masked_keys_on_the_vector_paths(kernel, q_heads, kv_heads, dims):
    """The vector paths (keys scored for a whole group, values summed in registers) with a key
    mask: masked rows holding NaN and infinities change nothing, row counts not a multiple of
    four included."""
    rng = np.random.default_rng(dims)
    rows = 37
    q = rng.standard_normal((2, q_heads, 1, dims), dtype=np.float32)
    k = rng.standard_normal((2, kv_heads, rows, dims), dtype=np.float32)
    v = rng.standard_normal((2, kv_heads, rows, dims), dtype=np.float32)
    held = rng.integers(1, rows + 1, size=(2, kv_heads))
    held[0, 0], held[1, -1] = rows, 0  # one head with every key, one with none
    mask = np.arange(rows)[None, None, :] < held[:, :, None]
    k[~mask], v[~mask] = np.nan, np.inf
    got = np.array(
        kernel.decode_attention(mx.array(q), mx.array(k), mx.array(v), 0.1, key_mask=mx.array(mask))
    )
    assert_held_rows_attended(got, q, k, v, held, 0.1)


def test_decode_attention_skips_masked_keys(kernel):
    """A key mask (a batch member's padding, a ragged head) gives those keys no weight: the
    same as attending the unmasked keys alone; a head with every key masked gives zeros."""
    rng = np.random.default_rng(5)
    q = rng.standard_normal((2, 6, 1, 32), dtype=np.float32)
    k = rng.standard_normal((2, 3, 50, 32), dtype=np.float32)
    v = rng.standard_normal((2, 3, 50, 32), dtype=np.float32)
    held = np.array([[50, 17, 1], [30, 0, 44]])  # rows each (sequence, KV head) may attend
    mask = np.arange(50)[None, None, :] < held[:, :, None]
    got = np.array(
        kernel.decode_attention(mx.array(q), mx.array(k), mx.array(v), 0.2, key_mask=mx.array(mask))
    )
    assert_held_rows_attended(got, q, k, v, held, 0.2)


def test_decode_attention_reads_keys_through_any_strides(kernel):
    """Keys stored transposed (each row strided) and queries from a wider buffer: read in
    place, with the same result."""
    rng = np.random.default_rng(8)
    q_buf = rng.standard_normal((1, 9, 1, 80), dtype=np.float32)
    k_t = rng.standard_normal((1, 3, 64, 40), dtype=np.float32)  # (B, H, D, S)
    v = rng.standard_normal((1, 3, 40, 64), dtype=np.float32)
    q, k = mx.array(q_buf)[..., :64], mx.array(k_t).swapaxes(2, 3)
    got = np.array(kernel.decode_attention(q, k, mx.array(v), 0.3))
    want = attention_reference(q_buf[..., :64], k_t.swapaxes(2, 3), v, 0.3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
