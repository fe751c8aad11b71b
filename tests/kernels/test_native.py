"""The native quantized matmul against numpy: codes unpacked by hand from MLX's documented
layout (element j of a uint32 word at bits ``bits * j``, ``w = scale * q + bias`` per group of
32), not by ``mx.dequantize``."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from qfserve.kernels import native


def unpack(w: np.ndarray, scales: np.ndarray, biases: np.ndarray, bits: int) -> np.ndarray:
    """The dense float64 weight of MLX affine codes, in numpy."""
    per_word = 32 // bits
    shifts = np.arange(per_word, dtype=np.uint32) * bits
    q = (w[..., None] >> shifts) & np.uint32((1 << bits) - 1)  # (N, words, per_word)
    q = q.reshape(w.shape[0], -1).astype(np.float64)  # (N, K)
    groups = q.reshape(q.shape[0], -1, 32)
    dense = groups * scales[..., None].astype(np.float64) + biases[..., None].astype(np.float64)
    return dense.reshape(q.shape)


def codes(rng: np.random.Generator, n: int, k: int, bits: int):
    w = mx.array(rng.integers(0, 2**32, size=(n, k * bits // 32), dtype=np.uint32))
    scales = mx.array(rng.uniform(0.001, 0.05, size=(n, k // 32)).astype(np.float32))
    biases = mx.array(rng.uniform(-0.2, 0.2, size=(n, k // 32)).astype(np.float32))
    return w, scales, biases


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("rows", [1, 3, 4, 9])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (1000, 576), (4100, 160)])
def test_products_match_numpy(kernel, bits, rows, n, k):
    rng = np.random.default_rng(rows * 1000 + n + bits)
    w, scales, biases = codes(rng, n, k, bits)
    x = mx.array(rng.standard_normal((rows, k), dtype=np.float32))
    got = np.array(kernel.quantized_matmul(x, w, scales, biases, bits))
    want = (
        np.array(x, dtype=np.float64)
        @ unpack(np.array(w), np.array(scales), np.array(biases), bits).T
    )
    assert got.shape == (rows, n) and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


def test_strided_batched_inputs_and_compile(kernel):
    """Leading axes and any strides are read in place (a transposed and a sliced view), and
    the primitive runs inside mx.compile."""
    rng = np.random.default_rng(1)
    w, scales, biases = codes(rng, 256, 128, 4)
    dense = unpack(np.array(w), np.array(scales), np.array(biases), 4)
    base = mx.array(rng.standard_normal((3, 128, 5), dtype=np.float32))
    view = base.transpose(2, 0, 1)[1:4:2]  # (2, 3, 128): strided on every axis
    got = np.array(kernel.quantized_matmul(view, w, scales, biases, 4))
    assert got.shape == (2, 3, 256)
    np.testing.assert_allclose(got, np.array(view, np.float64) @ dense.T, rtol=2e-5, atol=1e-4)
    x = mx.array(rng.standard_normal((128, 2), dtype=np.float32)).T  # (2, 128), not contiguous
    want = np.array(x, dtype=np.float64) @ dense.T
    got = kernel.quantized_matmul(x, w, scales, biases, 4)
    compiled = mx.compile(lambda a: kernel.quantized_matmul(a, w, scales, biases, 4) * 2.0)
    np.testing.assert_allclose(np.array(got), want, rtol=2e-5, atol=1e-4)
    np.testing.assert_allclose(np.array(compiled(x)), 2 * want, rtol=2e-5, atol=2e-4)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"bits": 3}, "bits must be 4 or 8"),
        ({"x": mx.zeros((1, 96))}, "shapes do not match"),
        ({"x": mx.zeros((1, 64), dtype=mx.float16)}, "must be float32"),
        ({"scales": mx.zeros((32, 3))}, "shapes do not match"),
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
@pytest.mark.parametrize(("batch", "q_heads", "kv_heads", "dims"), [(1, 9, 3, 64), (2, 4, 4, 40)])
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
    for b in range(2):
        for h in range(3):
            n, heads = held[b, h], slice(2 * h, 2 * h + 2)
            if n == 0:
                np.testing.assert_array_equal(got[b, heads], 0.0)
                continue
            want = attention_reference(
                q[b : b + 1, heads], k[b : b + 1, h : h + 1, :n], v[b : b + 1, h : h + 1, :n], 0.2
            )
            np.testing.assert_allclose(got[b, heads], want[0], rtol=1e-5, atol=1e-5)


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
