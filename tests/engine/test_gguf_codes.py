"""GGUF blocks as MLX affine codes (qfserve.engine.models.gguf.codes) against llama.cpp's own
``gguf.quants.dequantize`` of the same bytes: exactly for the types whose codes are kept, within
the documented rounding for the requantized ones; and MLX's own ``mx.dequantize`` reads the
packed words as the same values."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from qfserve.engine.models.gguf.codes import (
    EXACT_TYPES,
    GROUP_SIZE,
    pack,
    stored,
    tensor_codes,
)
from qfserve.engine.models.gguf.codes import (
    dequantize as codes_dequantize,
)
from tests.gguf_files import random_blocks

# Where the legacy types keep their float16 fields (byte offsets in a block).
LEGACY_HALVES = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,)}
BITS = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q8_0": 8, "Q4_K": 4, "Q5_K": 5}


def random_tensor(type_name: str, rows: int, k: int, seed: int, *, extreme: bool = False):
    return random_blocks(type_name, rows, k, seed, halves=LEGACY_HALVES.get(type_name),
                         extreme=extreme)  # fmt: skip


@pytest.mark.parametrize("type_name", sorted(EXACT_TYPES))
@pytest.mark.parametrize("extreme", [False, True])
def test_kept_codes_dequantize_exactly_as_llama_cpp(type_name, extreme):
    rows, k = 6, 512
    data = random_tensor(type_name, rows, k, seed=len(type_name), extreme=extreme)
    want = dequantize(data, GGMLQuantizationType[type_name]).reshape(rows, k)
    codes = tensor_codes(data, type_name, (rows, k))
    assert codes.bits == BITS[type_name]
    assert codes.q.max() < (1 << codes.bits)
    assert codes.scales.shape == (rows, k // GROUP_SIZE) and codes.scales.dtype == np.float32
    np.testing.assert_array_equal(codes_dequantize(codes), want)


@pytest.mark.parametrize("type_name", ["Q6_K", "Q3_K", "Q2_K"])
def test_other_types_are_requantized_within_half_an_8_bit_step(type_name):
    rows, k = 4, 512
    data = random_tensor(type_name, rows, k, seed=7)
    want = dequantize(data, GGMLQuantizationType[type_name]).reshape(rows, k)
    codes = tensor_codes(data, type_name, (rows, k))
    assert codes.bits == 8
    got = codes_dequantize(codes)
    groups = want.reshape(rows, -1, GROUP_SIZE)
    step = (groups.max(-1) - groups.min(-1)) / 255  # (rows, groups)
    err = np.abs(got - want).reshape(rows, -1, GROUP_SIZE).max(-1)
    rounding = 4 * np.finfo(np.float32).eps * np.abs(groups).max(-1)  # float32 arithmetic
    assert np.all(err <= step / 2 + rounding)
    if type_name == "Q6_K":  # a quarter of Q6_K's own step at most (1/63 of a sub-block's range)
        sub = want.reshape(rows, -1, 16)
        own = (sub.max(-1) - sub.min(-1)).reshape(rows, -1, 2).max(-1) / 63
        assert np.all(err <= own / 4 + rounding)


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_packed_words_are_what_mlx_dequantizes(bits):
    rng = np.random.default_rng(bits)
    q = rng.integers(0, 1 << bits, (5, 128), dtype=np.uint8)
    scales = rng.standard_normal((5, 4)).astype(np.float32)
    biases = rng.standard_normal((5, 4)).astype(np.float32)
    words = pack(q, bits)
    assert words.dtype == np.uint32 and words.shape == (5, 128 * bits // 32)
    got = mx.dequantize(
        mx.array(words), mx.array(scales), mx.array(biases), group_size=32, bits=bits
    )
    want = q.reshape(5, 4, 32) * scales[..., None] + biases[..., None]
    np.testing.assert_allclose(np.array(got), want.reshape(5, 128), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("type_name", sorted(EXACT_TYPES))
def test_stored_scales_are_float16_exact_for_legacy_types_and_within_half_an_ulp_for_k(type_name):
    """The folder's scales and biases: float16, exactly the file's for the legacy types (their
    d and m are float16), within float16's half-ulp (2^-11 relative) for Q4_K / Q5_K."""
    codes = tensor_codes(random_tensor(type_name, 8, 512, seed=3), type_name, (8, 512))
    scales, biases = stored(codes)
    assert scales.dtype == biases.dtype == np.float16
    for kept, exact in ((scales, codes.scales), (biases, codes.biases)):
        err = np.abs(kept.astype(np.float32) - exact)
        if type_name.endswith("_K"):
            assert np.all(err <= np.abs(exact) * 2.0**-11)
        else:
            np.testing.assert_array_equal(kept.astype(np.float32), exact)


def test_stored_keeps_float32_where_float16_would_lose_more():
    """Scales beyond float16's range, or so small they would be subnormal there, stay float32."""
    for value in (1e5, 1e-7):
        codes = tensor_codes(random_tensor("Q8_0", 2, 64, seed=1), "Q8_0", (2, 64))
        codes = type(codes)(codes.q, codes.scales * 0 + value, codes.biases * 0, codes.bits)
        scales, biases = stored(codes)
        assert scales.dtype == biases.dtype == np.float32
