"""GGUF quantized tensors as MLX affine codes: the file's own codes where the layouts map,
a measured requantization where they do not.

MLX's affine quantization stores, per group of ``group_size`` elements of a row,
``x = scale * q + bias`` with ``q`` an unsigned ``bits``-bit code, packed as a little-endian
bit stream into ``uint32`` words (``mx.quantize``'s layout; ``mx.dequantize`` and
``mx.quantized_matmul`` read it on every backend, and qfserve's native CPU kernels read it
too). llama.cpp's block layouts (``ggml-common.h``) are affine per block of 32 for most
types, so their codes are kept as they are, only repacked, and the scales are computed in
float32 exactly as llama.cpp dequantizes them, then stored in float16 where that rounds
within float16's precision (:func:`stored`: exact for the legacy types; for Q4_K and Q5_K,
whose ``d * sc`` needs up to 17 bits, a rounding of at most 2^-11 of each scale and bias,
under 1% of a quantization step; MLX's own quantized models keep half-precision scales too):

============  ==========================================  ======  ==================
GGUF type     llama.cpp's x                               bits    MLX scale, bias
============  ==========================================  ======  ==================
Q4_0          d * (q - 8)                                 4       d, -8d
Q4_1          d * q + m                                   4       d, m
Q5_0          d * (q - 16)                                5       d, -16d
Q5_1          d * q + m                                   5       d, m
Q8_0          d * q, q signed                             8       d, -128d (q + 128)
Q4_K          d * sc_j * q - dmin * m_j, 8 groups of 32   4       d * sc_j, -dmin * m_j
Q5_K          as Q4_K with 5-bit q                        5       d * sc_j, -dmin * m_j
============  ==========================================  ======  ==================

The others do not map onto groups of 32 with one scale: ``Q6_K`` has 16 sub-blocks of 16
(MLX's smallest group is 32), ``Q2_K`` / ``Q3_K`` likewise, and the IQ types use
non-uniform grids. They are dequantized by the ``gguf`` package and requantized to 8 bits in
groups of 32 (:data:`REQUANTIZE_BITS`), each group from its own minimum to its maximum: the
error is at most half a step of 1/255 of the group's range. On SmolLM2's ``Q4_K_M`` file
(made by ``llama-quantize``) that is 0.07 of ``Q6_K``'s own step in root mean square (its own
rounding is 0.29), 0.45% of the weights' magnitude, and at worst 0.98 of a step, in a
sub-block whose neighbour in the group has a much larger scale.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

GROUP_SIZE = 32  # every layout this module writes
REQUANTIZE_BITS = 8
QK_K = 256  # a K-quant super-block
# Types whose codes are kept (the table above); others are requantized.
EXACT_TYPES = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K"})
FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})


@dataclass(frozen=True)
class Codes:
    """One quantized weight, MLX's affine layout.

    Attributes:
        q: Unpacked codes, ``(N, K)`` uint8 (:func:`pack` gives MLX's ``uint32`` words).
        scales: ``(N, K / 32)`` float32.
        biases: ``(N, K / 32)`` float32.
        bits: Bits per code.
    """

    q: np.ndarray
    scales: np.ndarray
    biases: np.ndarray
    bits: int


def _f16(raw: np.ndarray) -> np.ndarray:
    """Bytes ``(n, 2)`` as float32 values ``(n, 1)`` (exact: float16 widens exactly)."""
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """``(n, 16 * c)`` bytes -> ``(n, 32 * c)`` codes: each 16 bytes hold elements 0-15 in
    their low nibbles and 16-31 in their high ones (llama.cpp's Q4/Q5 blocks)."""
    n = qs.shape[0]
    qs = qs.reshape(n, -1, 1, 16)
    return np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, -1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    """``(n, count / 8)`` bytes -> ``(n, count)`` bits, bit i of the little-endian stream."""
    return np.unpackbits(qh, axis=-1, bitorder="little")[:, :count]


def _legacy(blocks: np.ndarray, type_name: str) -> Codes:
    """Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 blocks ``(n, type_size)`` -> codes of ``(n, 32)``."""
    d = _f16(blocks[:, :2])
    if type_name == "Q8_0":
        q = (blocks[:, 2:].view(np.int8).astype(np.int16) + 128).astype(np.uint8)
        return Codes(q, d, -128 * d, 8)
    has_min = type_name in ("Q4_1", "Q5_1")
    rest = blocks[:, 4:] if has_min else blocks[:, 2:]
    if type_name.startswith("Q5"):
        q = _nibbles(rest[:, 4:]) | (_high_bits(rest[:, :4], 32) << 4)
        bits = 5
    else:
        q = _nibbles(rest)
        bits = 4
    bias = _f16(blocks[:, 2:4]) if has_min else -float(1 << (bits - 1)) * d
    return Codes(q.astype(np.uint8), d, bias, bits)


def _k_quant(blocks: np.ndarray, type_name: str) -> Codes:
    """Q4_K / Q5_K super-blocks ``(n, type_size)`` -> codes of ``(n, 256)``, 8 groups each."""
    from gguf.quants import Q4_K  # llama.cpp's own unpacking of the 6-bit scales and mins

    n = blocks.shape[0]
    d, dmin = _f16(blocks[:, :2]), _f16(blocks[:, 2:4])
    sc, m = Q4_K.get_scale_min(blocks[:, 4:16])  # (n, 8) each
    if type_name == "Q5_K":  # qh: 32 bytes, bit j of byte i is element 32 j + i's fifth bit
        qh, qs = blocks[:, 16:48], blocks[:, 48:]
        high = np.unpackbits(qh, axis=-1, bitorder="little").reshape(n, 32, 8)
        high = high.transpose(0, 2, 1).reshape(n, QK_K)
        bits = 5
    else:
        qs, high, bits = blocks[:, 16:], None, 4
    # qs: 4 chunks of 32 bytes; a chunk's low nibbles are group 2c, its high ones 2c + 1.
    qs = qs.reshape(n, 4, 1, 32)
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, QK_K)
    if high is not None:
        q = q | (high << 4)
    return Codes(
        q.astype(np.uint8), d * sc.astype(np.float32), -(dmin * m.astype(np.float32)), bits
    )


def stored(codes: Codes) -> tuple[np.ndarray, np.ndarray]:
    """Scales and biases as the folder stores them: float16 where every one of them rounds
    there within float16's own precision (half a unit in the last place, 2^-11 of the value:
    exact for the legacy types, whose ``d`` and ``m`` are float16 already), else float32.
    Half precision takes the scales' share of a 4-bit weight from 2 bits a value to 1."""
    both = np.stack([codes.scales, codes.biases])
    half = both.astype(np.float16)
    wide = half.astype(np.float32)
    if np.all(np.isfinite(wide)) and np.all(np.abs(wide - both) <= np.abs(both) * 2.0**-11):
        return half[0], half[1]
    return codes.scales, codes.biases


def requantize(values: np.ndarray, bits: int = REQUANTIZE_BITS) -> Codes:
    """Float rows ``(N, K)`` -> affine codes, each group of 32 from its minimum to its maximum
    (the least error of an affine code whose range covers the group)."""
    rows, k = values.shape
    groups = values.reshape(rows, k // GROUP_SIZE, GROUP_SIZE).astype(np.float32)
    lo, hi = groups.min(axis=-1), groups.max(axis=-1)
    levels = (1 << bits) - 1
    scales = ((hi - lo) / levels).astype(np.float32)
    safe = np.where(scales > 0, scales, 1.0).astype(np.float32)
    q = np.rint((groups - lo[..., None]) / safe[..., None])
    q = np.clip(q, 0, levels).astype(np.uint8).reshape(rows, k)
    return Codes(q, scales, lo.astype(np.float32), bits)


def tensor_codes(data: np.ndarray, type_name: str, shape: tuple[int, ...]) -> Codes:
    """A GGUF tensor's raw blocks as MLX affine codes.

    Args:
        data: The tensor's bytes as ``GGUFReader`` gives them (``(rows, bytes per row)``).
        type_name: Its GGML type name (``"Q4_K"``...).
        shape: Its shape, slowest dimension first (``(N, K)``).
    Returns:
        Codes of shape ``(N, K)``: the file's own for :data:`EXACT_TYPES`, else requantized.
    """
    from gguf import GGMLQuantizationType
    from gguf.constants import GGML_QUANT_SIZES

    rows, k = int(np.prod(shape[:-1])), int(shape[-1])
    qtype = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qtype]
    raw = np.ascontiguousarray(data).view(np.uint8).reshape(rows * k // block, size)
    if type_name in EXACT_TYPES:
        codes = _k_quant(raw, type_name) if type_name.endswith("_K") else _legacy(raw, type_name)
        return Codes(
            codes.q.reshape(rows, k),
            codes.scales.reshape(rows, k // GROUP_SIZE),
            codes.biases.reshape(rows, k // GROUP_SIZE),
            codes.bits,
        )
    from gguf.quants import dequantize

    return requantize(dequantize(raw, qtype).reshape(rows, k))


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """Codes ``(N, K)`` uint8 -> MLX's words ``(N, K * bits / 32)`` uint32: every 8 codes are
    ``bits`` bytes of a little-endian bit stream."""
    rows, k = q.shape
    eight = q.reshape(rows, k // 8, 8).astype(np.uint64)
    word = np.zeros((rows, k // 8), dtype=np.uint64)
    for j in range(8):
        word |= eight[..., j] << np.uint64(bits * j)
    stream = word.view(np.uint8).reshape(rows, k // 8, 8)[..., :bits]  # little-endian host
    return np.ascontiguousarray(stream).reshape(rows, -1).view(np.uint32)


def dequantize(codes: Codes) -> np.ndarray:
    """The float32 values ``(N, K)`` the codes stand for (a reference for tests)."""
    rows, k = codes.q.shape
    q = codes.q.reshape(rows, k // GROUP_SIZE, GROUP_SIZE).astype(np.float32)
    out = q * codes.scales[..., None] + codes.biases[..., None]
    return out.reshape(rows, k)
