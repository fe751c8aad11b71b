// A CPU matrix product for weights that stay quantized: MLX's affine layout (4, 5, 6 or 8
// bits, groups of 32, 64 or 128, float32 or float16 scales and biases: what every GGUF type
// converts to, and what `mlx_lm.convert -q` writes), float32 activations. A row's scales and
// biases are widened to float32 once, before its codes are read. Where the CPU has AVX-512
// VNNI or AVX2, a decode step's few rows are rounded to integers first (the section "Decode
// steps on integer activations" below), by default to 31 bits, float32's precision.
//
// Why by hand: MLX's own CPU quantized_matmul is several times slower than a float32 matrix
// product on the same weights (it is written for Metal first), so on the CPU the weights had
// to be held dequantized in float32: ~5x the file's bytes, read in full by every decode step.
// This op keeps only the codes:
//
// * Few rows of x (decode: one row per sequence, up to kFewRows): the codes are unpacked in
//   registers, 32 at a time, and accumulated in float32 on a small pool of threads,
//     y[m, n] = sum_g scale[n, g] * (q[n, g, :] . x[m, g, :]) + bias[n, g] * sum(x[m, g, :]),
//   the bias term from the group sums of x, computed once per call.
// * More rows (a prompt): a tile of the weight's rows at a time is dequantized into a buffer
//   of about a megabyte and multiplied with the BLAS's sgemm (the one MLX itself calls), so a
//   prefill runs at the BLAS's speed with no float32 copy of the weights held anywhere. ggml's
//   own CPU kernels were the other candidate: they quantize x to 8 bits (Q8_K) and take
//   integer dot products on the GGUF layouts themselves, which would tie the served weights
//   to llama.cpp's block formats (not MLX's, which Metal reads) and change the arithmetic.
//
// Codes are unpacked with AVX-512 VBMI's byte permute and multishift where the CPU has them
// (any bit width, in the elements' order), else 4 and 8 bits with shifts and masks, the others
// with AVX2's byte shuffle and a multiply a lane (or one byte at a time without AVX2); the dot
// products use simd.h's vectors (AVX-512, AVX2 or portable). For 4 bits on the fast path x is permuted per block of 32 so that a byte's low
// nibbles meet the even elements and its high nibbles the odd ones.

#include <dlfcn.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <tuple>
#include <vector>

#if defined(__SSE2__)
#include <immintrin.h>
#endif
#if defined(__AVX512VBMI__) && defined(__AVX512VL__)
#define QF_VBMI 1
#endif
#if defined(QF_VBMI) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define QF_VNNI 1
#endif

#include "detail.h"
#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "pool.h"
#include "rows.h"
#include "simd.h"

namespace mx = mlx::core;
using qfserve::Pool;
using qfserve::pool;
using qfserve::detail::Codes;
using namespace qfserve::simd;

namespace {

constexpr int kBlock = 32;  // codes unpacked at a time; a group is 1, 2 or 4 blocks
// Rows of x up to which the product is taken in registers (decode steps of a batch, which
// read each weight from memory once as codes); more rows (prompts) take dequantized tiles
// through the BLAS, whose blocking wins once rows reuse each weight. Measured on SmolLM2's
// projections (AVX-512, OpenBLAS, 2 cores): registers win up to ~24-32 rows, and the BLAS
// without a preloaded OpenBLAS far later.
constexpr int kFewRows = 32;
// Rows of x multiplied per pass over a weight row: each block of codes is unpacked once per
// pass, so more rows a pass amortise the unpacking. Eight rows' two accumulators fit
// AVX-512's 32 registers beside the unpacked block; AVX2's 16 hold four rows'.
#if defined(__AVX512F__)
constexpr int kPassRows = 8;
#else
constexpr int kPassRows = 4;
#endif
// Floats of weight dequantized at a time for the BLAS (16 MB): ~5% of SmolLM2's float32 copy.
constexpr int64_t kTileFloats = int64_t{1} << 22;

typedef uint8_t vb16 __attribute__((vector_size(16)));
typedef uint8_t vb16_unaligned __attribute__((vector_size(16), aligned(1)));

inline vb16 load16(const uint8_t* p) { return *reinterpret_cast<const vb16_unaligned*>(p); }

// 16 floats, a block's half: one vector with AVX-512, two with AVX2, four otherwise.
constexpr int kParts = 16 / W;
struct v16 {
  vf p[kParts];
  v16& operator*=(vf s) {
    for (vf& v : p) v *= s;
    return *this;
  }
};

// 16 codes as 16 floats. GCC's __builtin_convertvector from bytes to floats is scalarised
// (~1 ns a code); the widening instructions take one zero-extension and one conversion.
inline v16 widen(vb16 b) {
#if defined(__AVX512F__)
  return {reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(reinterpret_cast<__m128i>(b))))};
#elif defined(__AVX2__)
  const __m128i v = reinterpret_cast<__m128i>(b);
  return {reinterpret_cast<vf>(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v))),
          reinterpret_cast<vf>(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8))))};
#else
  v16 out;
  for (int k = 0; k < kParts; ++k)
    for (int i = 0; i < W; ++i) out.p[k][i] = b[k * W + i];
  return out;
#endif
}

// The 32 codes of one block (4 * BITS bytes), in the elements' order, into out.
template <int BITS>
inline void unpack_bytes(const uint8_t* w, uint8_t* out) {
  if constexpr (BITS == 8) {
    std::memcpy(out, w, kBlock);
  } else {
    for (int j = 0; j < 4; ++j) {  // 8 codes are BITS bytes of a little-endian bit stream
      uint64_t v = 0;
      std::memcpy(&v, w + j * BITS, BITS);
      for (int k = 0; k < 8; ++k) out[j * 8 + k] = (v >> (k * BITS)) & ((1u << BITS) - 1);
    }
  }
}

#ifdef QF_VBMI
// Byte j * 8 + k of the permute takes byte j * BITS + k of the block (pack j into 64-bit lane
// j); of the multishift, bit offset k * BITS of its lane (code k of the pack).
template <int BITS>
struct Unpack {
  alignas(32) static constexpr auto idx = [] {
    std::array<uint8_t, 32> a{};
    for (int i = 0; i < 32; ++i) a[i] = static_cast<uint8_t>(std::min(i / 8 * BITS + i % 8, 31));
    return a;
  }();
  // 64 entries: a register of two blocks (the integer products' pairs) reads them all.
  alignas(64) static constexpr auto shift = [] {
    std::array<uint8_t, 64> a{};
    for (int i = 0; i < 64; ++i) a[i] = static_cast<uint8_t>(i % 8 * BITS);
    return a;
  }();
};

// 8 codes are BITS bytes: byte-permute pack j into 64-bit lane j, then multishift takes
// code k from bit k * BITS of its lane.
template <int BITS>
inline __m256i unpack_vbmi(const uint8_t* w) {
  const __mmask32 mask = BITS == 8 ? 0xffffffffu : (1u << (4 * BITS)) - 1;
  const __m256i raw = _mm256_maskz_loadu_epi8(mask, w);  // never past the block
  const __m256i lanes = _mm256_permutexvar_epi8(
      _mm256_load_si256(reinterpret_cast<const __m256i*>(Unpack<BITS>::idx.data())), raw);
  const __m256i codes = _mm256_multishift_epi64_epi8(
      _mm256_load_si256(reinterpret_cast<const __m256i*>(Unpack<BITS>::shift.data())), lanes);
  return _mm256_and_si256(codes, _mm256_set1_epi8(static_cast<char>((1 << BITS) - 1)));
}
#endif

#if defined(__AVX2__) && !defined(QF_VBMI)
// Codes of any width without VBMI (AVX2): half a block's 16 codes (2 * BITS bytes) as 16-bit
// lanes. A byte shuffle puts the two bytes holding code t in lane t, and a multiply by
// 2^(8 - its bit offset) moves the code to bits 8..8+BITS of the lane (AVX2 has no per-lane
// 16-bit shift), so a shift by 8 and a mask leave it. Why: byte at a time, 5- and 6-bit
// codes (Q5_0, Q5_K, Q6_K files: most of a Q4_K_M file) cost ~8x the 4-bit ones.
template <int BITS>
struct HalfUnpack {
  static constexpr auto bit = [](int t) { return t * BITS; };
  alignas(32) static constexpr auto idx = [] {  // lane L of the register: codes 8L..8L+7
    std::array<uint8_t, 32> a{};
    for (int i = 0; i < 32; ++i) {
      const int t = i / 2, byte = bit(t) / 8 + i % 2;
      a[i] = static_cast<uint8_t>(byte);
    }
    return a;
  }();
  alignas(32) static constexpr auto mul = [] {
    std::array<uint16_t, 16> a{};
    for (int t = 0; t < 16; ++t) a[t] = static_cast<uint16_t>(1u << (8 - bit(t) % 8));
    return a;
  }();
};

// The codes' 16 bytes from w on are read in one load (the ones past the half are the next
// codes', never used) except within 16 bytes of the weight's end, which are copied.
template <int BITS>
inline __m256i half_codes(const uint8_t* w, const uint8_t* end) {
  __m128i raw;
  if (w + 16 <= end) {
    raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  } else {
    alignas(16) uint8_t bytes[16] = {};
    std::memcpy(bytes, w, 2 * BITS);
    raw = _mm_load_si128(reinterpret_cast<const __m128i*>(bytes));
  }
  const __m256i src = _mm256_broadcastsi128_si256(raw);
  const __m256i pairs =
      _mm256_shuffle_epi8(src, _mm256_load_si256(reinterpret_cast<const __m256i*>(HalfUnpack<BITS>::idx.data())));
  const __m256i moved =
      _mm256_mullo_epi16(pairs, _mm256_load_si256(reinterpret_cast<const __m256i*>(HalfUnpack<BITS>::mul.data())));
  return _mm256_and_si256(_mm256_srli_epi16(moved, 8), _mm256_set1_epi16((1 << BITS) - 1));
}

inline v16 widen16(__m256i codes) {  // 16 codes in 16-bit lanes as 16 floats
#if defined(__AVX512F__)
  return {reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(codes)))};
#else
  return {reinterpret_cast<vf>(_mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(codes)))),
          reinterpret_cast<vf>(_mm256_cvtepi32_ps(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(codes, 1))))};
#endif
}
#endif

// A block's codes as two halves of 16 floats, in the order :func:`stage` stores x.
template <int BITS>
inline void block_floats(const uint8_t* w, const uint8_t* end, v16& f0, v16& f1) {
#ifdef QF_VBMI
  if constexpr (BITS != 4 && BITS != 8) {
    const __m256i codes = unpack_vbmi<BITS>(w);
    f0 = widen(reinterpret_cast<vb16>(_mm256_castsi256_si128(codes)));
    f1 = widen(reinterpret_cast<vb16>(_mm256_extracti128_si256(codes, 1)));
    return;
  }
#endif
  if constexpr (BITS == 4) {  // x permuted: low nibbles (even elements), then high (odd)
#if defined(__AVX512F__)
    // One widening of the 16 bytes, then mask and shift the 32-bit lanes: widening uses the
    // shuffle port, which two widenings a block would saturate.
    const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    f0 = {reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0f))))};
    f1 = {reinterpret_cast<vf>(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)))};
#elif defined(__SSE2__)
    // x86 has no byte shift: GCC scalarises one on byte vectors; shift 16-bit lanes, mask.
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    const __m128i mask = _mm_set1_epi8(0x0f);
    f0 = widen(reinterpret_cast<vb16>(_mm_and_si128(b, mask)));
    f1 = widen(reinterpret_cast<vb16>(_mm_and_si128(_mm_srli_epi16(b, 4), mask)));
#else
    const vb16 b = load16(w);
    f0 = widen(b & 0x0f);
    f1 = widen(b >> 4);
#endif
  } else if constexpr (BITS == 8) {
    f0 = widen(load16(w));
    f1 = widen(load16(w + 16));
  } else {
#if defined(__AVX2__) && !defined(QF_VBMI)
    f0 = widen16(half_codes<BITS>(w, end));
    f1 = widen16(half_codes<BITS>(w + 2 * BITS, end));
    return;
#endif
    alignas(16) uint8_t codes[kBlock];
    unpack_bytes<BITS>(w, codes);
    f0 = widen(*reinterpret_cast<const vb16*>(codes));
    f1 = widen(*reinterpret_cast<const vb16*>(codes + 16));
  }
}

// The same codes in the elements' order (dequantization).
template <int BITS>
inline void block_floats_ordered(const uint8_t* w, const uint8_t* end, v16& f0, v16& f1) {
  if constexpr (BITS == 4) {
#ifdef QF_VBMI
    const __m256i codes = unpack_vbmi<4>(w);
    f0 = widen(reinterpret_cast<vb16>(_mm256_castsi256_si128(codes)));
    f1 = widen(reinterpret_cast<vb16>(_mm256_extracti128_si256(codes, 1)));
#elif defined(__SSE2__)
    // Byte i holds elements 2i (low nibble) and 2i + 1: interleave the nibbles.
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    const __m128i mask = _mm_set1_epi8(0x0f);
    const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
    f0 = widen(reinterpret_cast<vb16>(_mm_unpacklo_epi8(lo, hi)));
    f1 = widen(reinterpret_cast<vb16>(_mm_unpackhi_epi8(lo, hi)));
#else
    alignas(16) uint8_t codes[kBlock];
    unpack_bytes<4>(w, codes);
    f0 = widen(*reinterpret_cast<const vb16*>(codes));
    f1 = widen(*reinterpret_cast<const vb16*>(codes + 16));
#endif
  } else {
    block_floats<BITS>(w, end, f0, f1);
  }
}

// float16 (IEEE binary16 bits) to float32, exactly.
inline float widen_half(uint16_t h) {
#ifdef __F16C__
  return _cvtsh_ss(h);
#else
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal: normalise
    exp = 113;
    while (!(man & 0x400)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// count float16 values at src as float32 at dst.
inline void widen_halves(const uint16_t* src, float* dst, int count) {
  int i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= count; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#elif defined(__F16C__)
  for (; i + 8 <= count; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i))));
#endif
  for (; i < count; ++i) dst[i] = widen_half(src[i]);
}

// Rows [n, n + count)'s scales and biases as float32: in place for float32 ones, else
// widened into buf (2 * count * G floats), all of them at once (contiguous, one vector
// conversion per 16; a row at a time, SmolLM2's 18 groups a row, cost more than the row).
inline std::pair<const float*, const float*> block_params(const Codes& c, int n, int count,
                                                           float* buf) {
  const int G = c.K / c.group;
  const size_t at = static_cast<size_t>(n) * G;
  if (!c.half)
    return {static_cast<const float*>(c.scales) + at, static_cast<const float*>(c.biases) + at};
  widen_halves(static_cast<const uint16_t*>(c.scales) + at, buf, count * G);
  widen_halves(static_cast<const uint16_t*>(c.biases) + at, buf + count * G, count * G);
  return {buf, buf + count * G};
}

constexpr int kParamRows = 32;  // rows whose scales are widened at a time

// Rows [n0, n1)'s float32 scales and biases, asked for in order: widened kParamRows rows at
// a time (block_params).
class RowParams {
 public:
  RowParams(const Codes& c, int n0, int n1)
      : c_(c), n0_(n0), n1_(n1), G_(c.K / c.group),
        buf_(c.half ? 2 * static_cast<size_t>(kParamRows) * G_ : 0) {}
  std::pair<const float*, const float*> at(int n) {
    const int in_block = (n - n0_) % kParamRows;
    if (in_block == 0)
      std::tie(s_, b_) = block_params(c_, n, std::min(kParamRows, n1_ - n), buf_.data());
    return {s_ + static_cast<size_t>(in_block) * G_, b_ + static_cast<size_t>(in_block) * G_};
  }

 private:
  const Codes& c_;
  int n0_, n1_, G_;
  std::vector<float> buf_;
  const float *s_ = nullptr, *b_ = nullptr;
};

// A decode step reads every weight once, from memory: the codes, scales and biases of row
// n + kAhead are asked for while row n is multiplied, so that its loads wait less (measured
// on SmolLM2 at Q4_K_M, one sequence: 19.4 -> 17.2 ms a step; the distance matters little
// between 4 and 16 rows).
constexpr int kAhead = 16;

inline void prefetch_row(const Codes& c, int n, int n1, size_t row_bytes) {
  if (n + kAhead >= n1) return;
  const char* next = reinterpret_cast<const char*>(c.w) + (n + kAhead) * row_bytes;
  for (size_t at = 0; at < row_bytes; at += 64) __builtin_prefetch(next + at, 0, 3);
  const size_t params = static_cast<size_t>(c.K / c.group) * (c.half ? 2 : 4);
  __builtin_prefetch(static_cast<const char*>(c.scales) + (n + kAhead) * params, 0, 3);
  __builtin_prefetch(static_cast<const char*>(c.biases) + (n + kAhead) * params, 0, 3);
}

template <int BITS, int MB>
void rows(const Codes& c, const float* xp, const float* xs, float* y, int n0, int n1) {
  const int K = c.K, G = K / c.group, N = c.N;
  const int shift = c.group == 32 ? 0 : (c.group == 64 ? 1 : 2);  // block -> group
  const uint8_t* const w = c.w;
  const size_t row_bytes = static_cast<size_t>(K) * BITS / 8;
  const uint8_t* const end = w + static_cast<size_t>(N) * row_bytes;
  RowParams params(c, n0, n1);
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wn = w + n * row_bytes;
    const auto [sn, bn] = params.at(n);
    vf acc[MB], acc1[MB];  // two chains a row: the block's halves add independently
    float bias_sum[MB];
    for (int m = 0; m < MB; ++m) {
      acc[m] = acc1[m] = vf{};
      bias_sum[m] = 0.f;
    }
    for (int blk = 0; blk < K / kBlock; ++blk) {
      const vf s = splat(sn[blk >> shift]);
      v16 f0, f1;
      block_floats<BITS>(wn + blk * (kBlock * BITS / 8), end, f0, f1);
      f0 *= s;  // scaled once per block, not once per row of x
      f1 *= s;
      for (int m = 0; m < MB; ++m) {
        const float* xb = xp + static_cast<size_t>(m) * K + blk * kBlock;
        for (int k = 0; k < kParts; ++k) {
          acc[m] += f0.p[k] * load(xb + k * W);
          acc1[m] += f1.p[k] * load(xb + 16 + k * W);
        }
      }
    }
    for (int g = 0; g < G; ++g)
      for (int m = 0; m < MB; ++m) bias_sum[m] += bn[g] * xs[static_cast<size_t>(m) * G + g];
    for (int m = 0; m < MB; ++m)
      y[static_cast<size_t>(m) * N + n] = hsum(acc[m] + acc1[m]) + bias_sum[m];
  }
}

// x's rows copied contiguous (permuted per block for 4 bits) and their group sums.
template <int BITS>
void stage(const Codes& c, const float* x, const std::vector<int64_t>& row_offset,
           int64_t col_stride, int M, std::vector<float>& xp, std::vector<float>& xs) {
  const int K = c.K, G = K / c.group;
  xp.resize(static_cast<size_t>(M) * K);
  xs.assign(static_cast<size_t>(M) * G, 0.f);
  for (int m = 0; m < M; ++m) {
    for (int b = 0; b < K / kBlock; ++b) {
      const float* src = x + row_offset[m] + b * kBlock * col_stride;
      float* dst = xp.data() + static_cast<size_t>(m) * K + b * kBlock;
      float sum = 0.f;
      for (int t = 0; t < kBlock; ++t) {
        const float v = src[t * col_stride];
        sum += v;
        dst[BITS == 4 ? ((t & 1) ? 16 + t / 2 : t / 2) : t] = v;
      }
      xs[static_cast<size_t>(m) * G + b * kBlock / c.group] += sum;
    }
  }
}

// f.template operator()<BITS>() for the codes' bit width.
template <typename F>
decltype(auto) with_bits(int bits, F&& f) {
  switch (bits) {
    case 4: return f.template operator()<4>();
    case 5: return f.template operator()<5>();
    case 6: return f.template operator()<6>();
    default: return f.template operator()<8>();
  }
}

// A few-row product's work: the weight's N rows in chunks over the pool, and in each chunk
// x's M rows in passes of kPassRows, 4 and 1: pass.template operator()<MB>(m, n0, n1).
template <typename Pass>
void in_passes(int N, int K, int M, const Pass& pass) {
  Pool& p = pool();
  // Below ~256k multiply-adds (tens of microseconds) one thread is faster than waking another.
  const bool split = static_cast<int64_t>(N) * K * M >= (int64_t{1} << 18);
  // Chunks of at least 32 rows, about four per thread, so a late or busy thread costs little.
  const int chunks = split ? std::max(1, std::min(N / 32, 4 * p.threads())) : 1;
  const int per = (N + chunks - 1) / chunks;
  p.run(chunks, [&](int chunk) {
    const int n0 = chunk * per, n1 = std::min(n0 + per, N);
    int m = 0;
    for (; m + kPassRows <= M; m += kPassRows) pass.template operator()<kPassRows>(m, n0, n1);
    for (; m + 4 <= M; m += 4) pass.template operator()<4>(m, n0, n1);
    for (; m < M; ++m) pass.template operator()<1>(m, n0, n1);
  });
}

template <int BITS>
void few_rows(const Codes& c, const float* x, const std::vector<int64_t>& row_offset,
              int64_t col_stride, float* y, int M) {
  // The calling thread's staging, kept between calls as the integer path's (see there).
  thread_local std::vector<float> kept_xp, kept_xs;
  std::vector<float>&xp = kept_xp, &xs = kept_xs;
  stage<BITS>(c, x, row_offset, col_stride, M, xp, xs);
  const int K = c.K, G = K / c.group, N = c.N;
  in_passes(N, K, M, [&]<int MB>(int m, int n0, int n1) {
    rows<BITS, MB>(c, xp.data() + static_cast<size_t>(m) * K,
                   xs.data() + static_cast<size_t>(m) * G, y + static_cast<size_t>(m) * N, n0,
                   n1);
  });
}

// Decode steps on integer activations (AVX-512 VNNI). Each block of 32 elements of x is
// rounded with its own scale (max |x| / 127 to int8, as llama.cpp's Q8_0 for activations,
// max |x| / 32767 to int16, or to 31 bits held as two int16 halves: Held<int32_t>), and the
// codes stay integers: a pair of blocks' codes as 64 bytes meets x in `vpdpbusd` (bytes
// times int8, four products summed into each int32 lane) or, widened to 16 bits, in
// `vpdpwssd` (two a lane; once per half for 31 bits). The lanes are widened and scaled by the
// weight's scale times x's once per pair of blocks:
//   y[m, n] = sum_b scale[n, g(b)] * d[m, b] * (q[n, b, :] . xq[m, b, :]) + bias[n, g] * sum(x[m, g, :]),
// the bias term from x's exact float sums. Why: the float path widens every code to a float
// (two conversions on the shuffle port a block of 32) before its multiply-adds, which bounds
// a decode step's products far below the core's arithmetic. What it costs: x's rounding,
// |error| <= half a step (max |x in the block| / 254 or / 65534) an element, or float32's own
// rounding of x * 2^30 / max for 31 bits; the tests hold the products to that bound, and
// docs/models.md gives what each does to greedy text.
std::atomic<int> activations_on{32};  // 0 (float32), 8, 16 or 32

#if defined(QF_VNNI) || (defined(__AVX2__) && !defined(QF_VBMI))
namespace qx {
// How x is held a block: int8 or int16 as is; int32 (31-bit integers: float32's precision
// relative to the block's largest element) as two int16 halves, x = high * 2^15 + low with
// low in [0, 2^15), so that each half's products are exact in int32 (vpdpwssd, vpmaddwd).
template <typename X>
struct Held {
  using type = X;
  static constexpr int parts = 1;
  static constexpr float top = sizeof(X) == 1 ? 127.f : 32767.f;
};
template <>
struct Held<int32_t> {
  using type = int16_t;
  static constexpr int parts = 2;
  static constexpr float top = 1073676288.f;  // 2^30 - 2^16: the high half stays an int16
};
}  // namespace qx
#endif

#ifdef QF_VNNI
namespace qx {

// Rows of x up to which each is faster than the float path (measured on SmolLM2's shapes, 2
// cores): int8, one product a pair, at every count up to 32; int16, two products and two
// widenings a pair, up to 4 (1.5x at one row, no faster at 8); int32, four products a pair,
// up to 3 (1.2x at one to three rows, slower at 4). Past those the float path takes over.
constexpr int kRows8 = kFewRows, kRows16 = 4, kRows32 = 3;

// A pair of blocks' codes as 64 bytes: its four 16-byte quarters are [first block, second
// block, first block, second block] (4 bits: a byte's low nibbles, even elements, then its
// high nibbles; else elements 0-15, then 16-31), so the int32 lanes of either product group
// by block the same way for every bit width. position: where element t of block b (0 or 1)
// of the pair sits.
template <int BITS>
constexpr int position(int b, int t) {
  return BITS == 4 ? (t & 1 ? 32 : 0) + b * 16 + t / 2 : t / 16 * 32 + b * 16 + t % 16;
}
// The int32 lanes of the second block: each 16 bytes of int8 is 4 lanes; the int16 product
// sums both halves of the register, each 16 elements being 8 lanes.
template <typename X>
constexpr __mmask16 second = sizeof(X) == 1 ? 0xF0F0 : 0xFF00;

// Byte permute as unpack_vbmi's (its multishift too), over a register of two blocks: 64-bit
// lane l (8 codes) takes pack (l / 4 * 2 + l % 2) of block (l / 2) % 2, for position's order.
template <int BITS>
struct PairUnpack {
  static constexpr int bytes = kBlock * BITS / 8;
  alignas(64) static constexpr auto idx = [] {
    std::array<uint8_t, 64> a{};
    for (int i = 0; i < 64; ++i) {
      const int lane = i / 8, block = lane / 2 % 2, pack = lane / 4 * 2 + lane % 2;
      a[i] = static_cast<uint8_t>(std::min(block * bytes + pack * BITS + i % 8, 63));
    }
    return a;
  }();
};

// The codes of blocks w and w + 1 (or of w alone, the rest zero: a row's odd last block) as
// 64 bytes in position<BITS>'s order; never reads past the blocks.
template <int BITS>
inline __m512i pair_codes(const uint8_t* w, bool one) {
  constexpr int bytes = PairUnpack<BITS>::bytes;
  if constexpr (BITS == 4) {
    const __m256i v = _mm256_maskz_loadu_epi8(one ? 0xffffu : 0xffffffffu, w);
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(v), _mm256_srli_epi16(v, 4), 1);
    return _mm512_and_si512(both, _mm512_set1_epi8(0x0f));
  } else if constexpr (BITS == 8) {  // quarters of 16 codes: [0, 2, 1, 3] of the 64 bytes
    const __m512i raw = _mm512_maskz_loadu_epi8(one ? 0xffffffffull : ~0ull, w);
    return _mm512_shuffle_i64x2(raw, raw, 0b11011000);
  } else {
    const __m512i raw = _mm512_maskz_loadu_epi8((1ull << (one ? bytes : 2 * bytes)) - 1, w);
    const __m512i lanes =
        _mm512_permutexvar_epi8(_mm512_load_si512(PairUnpack<BITS>::idx.data()), raw);
    const __m512i codes =
        _mm512_multishift_epi64_epi8(_mm512_load_si512(Unpack<BITS>::shift.data()), lanes);
    return _mm512_and_si512(codes, _mm512_set1_epi8(static_cast<char>((1 << BITS) - 1)));
  }
}

// x's rows rounded per block: q (M, pairs * 64 * parts) in position<BITS>'s order (int32:
// a pair's high halves, then its low), d (M, pairs * 16) each int32 lane's scale of x (0 in
// a missing last block), and the group sums of x itself for the bias term.
template <typename X>
struct Staged {
  std::vector<typename Held<X>::type> q;
  std::vector<float> d, sums;
  int pairs = 0;
};

template <int BITS, typename X>
void stage(const Codes& c, const float* x, const std::vector<int64_t>& row_offset,
           int64_t col_stride, int M, Staged<X>& s) {
  constexpr float top = Held<X>::top;
  const int K = c.K, G = K / c.group, blocks = K / kBlock;
  s.pairs = (blocks + 1) / 2;
  const size_t row_q = static_cast<size_t>(s.pairs) * 64 * Held<X>::parts,
               row_d = static_cast<size_t>(s.pairs) * 16;
  s.q.assign(M * row_q, 0);
  s.d.assign(M * row_d, 0.f);
  s.sums.assign(static_cast<size_t>(M) * G, 0.f);
  alignas(64) float v[kBlock];
  alignas(64) int32_t r[kBlock];
  for (int m = 0; m < M; ++m) {
    for (int b = 0; b < blocks; ++b) {
      const float* src = x + row_offset[m] + b * kBlock * col_stride;
      if (col_stride == 1) {
        std::memcpy(v, src, sizeof v);
      } else {
        for (int t = 0; t < kBlock; ++t) v[t] = src[t * col_stride];
      }
      const __m512 lo = _mm512_load_ps(v), hi = _mm512_load_ps(v + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
      const __m512 k = _mm512_set1_ps(amax > 0.f ? top / amax : 0.f);
      // Rounded to nearest even; |x * k| <= top, so the narrowing never saturates (a NaN's
      // integer is garbage, but its d is NaN, so the product is NaN as the float path's).
      _mm512_store_si512(r, _mm512_cvtps_epi32(_mm512_mul_ps(lo, k)));
      _mm512_store_si512(r + 16, _mm512_cvtps_epi32(_mm512_mul_ps(hi, k)));
      auto* q = s.q.data() + m * row_q + static_cast<size_t>(b / 2) * 64 * Held<X>::parts;
      for (int t = 0; t < kBlock; ++t) {
        if constexpr (Held<X>::parts == 2) {
          q[position<BITS>(b & 1, t)] = static_cast<int16_t>(r[t] >> 15);
          q[64 + position<BITS>(b & 1, t)] = static_cast<int16_t>(r[t] & 0x7fff);
        } else {
          q[position<BITS>(b & 1, t)] = static_cast<X>(r[t]);
        }
      }
      float* d = s.d.data() + m * row_d + static_cast<size_t>(b / 2) * 16;
      for (int lane = 0; lane < 16; ++lane)
        if (((second<X> >> lane) & 1) == (b & 1)) d[lane] = amax / top;
      s.sums[static_cast<size_t>(m) * G + b * kBlock / c.group] +=
          _mm512_reduce_add_ps(_mm512_add_ps(lo, hi));
    }
  }
}

// A pair's integer dot products for one row of x: int8 in one instruction; int16 with the
// codes widened once a pair (lo and hi, shared by the rows) and two.
inline __m512i dot(const __m512i& codes, const __m512i&, const __m512i&, const int8_t* xq) {
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, _mm512_loadu_si512(xq));
}
inline __m512i dot(const __m512i&, const __m512i& lo, const __m512i& hi, const int16_t* xq) {
  const __m512i first = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo, _mm512_loadu_si512(xq));
  return _mm512_dpwssd_epi32(first, hi, _mm512_loadu_si512(xq + 32));
}

// A row's scales or biases as read: float16 (the converted folders) or float32.
struct Params {
  const void* p;
  bool half;
  float at(int g) const {
    return half ? widen_half(static_cast<const uint16_t*>(p)[g]) : static_cast<const float*>(p)[g];
  }
  // Elements g and g + 1 in lanes 0 and 1 (both in bounds).
  __m128 two(int g) const {
    if (half)
      return _mm_cvtph_ps(_mm_maskz_loadu_epi16(0x3, static_cast<const uint16_t*>(p) + g));
    return _mm_maskz_loadu_ps(0x3, static_cast<const float*>(p) + g);
  }
  // sum_g this[g] * x[g] over G groups.
  float dot(const float* x, int G) const {
    __m512 acc = _mm512_setzero_ps();
    for (int g = 0; g < G; g += 16) {
      const __mmask16 live = G - g >= 16 ? 0xffff : static_cast<__mmask16>((1u << (G - g)) - 1);
      const __m512 v =
          half ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, static_cast<const uint16_t*>(p) + g))
               : _mm512_maskz_loadu_ps(live, static_cast<const float*>(p) + g);
      acc = _mm512_fmadd_ps(v, _mm512_maskz_loadu_ps(live, x + g), acc);
    }
    return _mm512_reduce_add_ps(acc);
  }
};

template <int BITS, int MB, typename X>
void rows(const Codes& c, const Staged<X>& s, int m0, float* y, int n0, int n1) {
  const int K = c.K, G = K / c.group, N = c.N, blocks = K / kBlock;
  const int shift = c.group == 32 ? 0 : (c.group == 64 ? 1 : 2);  // block -> group
  const size_t row_bytes = static_cast<size_t>(K) * BITS / 8;
  const size_t row_q = static_cast<size_t>(s.pairs) * 64 * Held<X>::parts,
               row_d = static_cast<size_t>(s.pairs) * 16;
  const size_t param_bytes = static_cast<size_t>(G) * (c.half ? 2 : 4);
  const auto* const xq = s.q.data() + m0 * row_q;
  const float* const xd = s.d.data() + m0 * row_d;
  const float* const xs = s.sums.data() + static_cast<size_t>(m0) * G;
  // A pair's two scales to its lanes: lane i takes element (second<X> >> i) & 1.
  const __m512i to_lanes = _mm512_maskz_set1_epi32(second<X>, 1);
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wn = c.w + n * row_bytes;
    const Params sn{static_cast<const char*>(c.scales) + n * param_bytes, c.half};
    const Params bn{static_cast<const char*>(c.biases) + n * param_bytes, c.half};
    prefetch_row(c, n, n1, row_bytes);
    __m512 acc[MB], acc1[MB];  // two chains a row: even and odd pairs add independently
    for (int m = 0; m < MB; ++m) acc[m] = acc1[m] = _mm512_setzero_ps();
    const auto pair = [&](int p, __m512* into) {
      const int blk = 2 * p;
      const bool one = blk + 1 == blocks;
      const __m512i codes = pair_codes<BITS>(wn + blk * (kBlock * BITS / 8), one);
      __m512i lo{}, hi{};
      if constexpr (sizeof(X) >= 2) {
        lo = _mm512_cvtepu8_epi16(_mm512_castsi512_si256(codes));
        hi = _mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(codes, 1));
      }
      // Groups of 32: the pair's two scales; else (or a last lone block) one for both.
      const __m512 sv = shift == 0 && !one
                            ? _mm512_permutexvar_ps(to_lanes, _mm512_castps128_ps512(sn.two(blk)))
                            : _mm512_set1_ps(sn.at(blk >> shift));
      for (int m = 0; m < MB; ++m) {
        const auto* xm = xq + m * row_q + p * 64 * Held<X>::parts;
        const __m512 scale = _mm512_mul_ps(sv, _mm512_loadu_ps(xd + m * row_d + p * 16));
        __m512 sums;
        if constexpr (Held<X>::parts == 2) {  // high * 2^15 + low: exact, then rounded once
          sums = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot(codes, lo, hi, xm)),
                                 _mm512_set1_ps(32768.f),
                                 _mm512_cvtepi32_ps(dot(codes, lo, hi, xm + 64)));
        } else {
          sums = _mm512_cvtepi32_ps(dot(codes, lo, hi, xm));
        }
        into[m] = _mm512_fmadd_ps(sums, scale, into[m]);
      }
    };
    int p = 0;
    for (; p + 2 <= s.pairs; p += 2) {
      pair(p, acc);
      pair(p + 1, acc1);
    }
    if (p < s.pairs) pair(p, acc);
    for (int m = 0; m < MB; ++m)
      y[static_cast<size_t>(m) * N + n] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], acc1[m])) +
                                          bn.dot(xs + static_cast<size_t>(m) * G, G);
  }
}

}  // namespace qx
#elif defined(__AVX2__) && !defined(QF_VBMI)
// The same on AVX2 (no VNNI), one block of 32 elements a register, as llama.cpp's AVX2
// kernels: int8 x meets byte codes in `vpmaddubsw` (unsigned codes times int8, pairs summed
// to int16: at most 2 * 63 * 127 for 6-bit codes, so never saturated), then `vpmaddwd` by
// ones to int32; 8-bit codes are offset to int8 (q - 128, with 128 times the block's sum of
// rounded x put back) and their sign moved onto x, so a pair stays within 2 * 128 * 127. int16 and
// 31-bit x take the codes widened to 16 bits and `vpmaddwd`. Each block's int32 lanes are
// converted and scaled by the weight's scale times x's once. Why: on AVX2 the float path
// spends more on turning codes into floats (two conversions a code) than on multiplying.
namespace qx {

// Rows of x up to which each is faster than the float path (measured on SmolLM2's shapes,
// Zen 3, 2 cores; 4- to 8-bit codes): int8 and int16 1.5-2.6x at one row, 1.1-1.5x at two or
// three; int32 1.2-2x at one to three rows, slower from four; past eight rows all are at the
// float path's speed. As the VNNI path's, then.
constexpr int kRows8 = kFewRows, kRows16 = 4, kRows32 = 3;

// Where element t of a block sits in its register (bytes for int8, else 16-bit lanes over
// two registers): 4-bit codes as a byte's low nibbles (even elements), then its high ones;
// 5- and 6-bit codes packed to bytes from two registers of 16-bit lanes, whose 128-bit
// halves interleave (elements 0-7, 16-23, 8-15, 24-31); else in order.
template <int BITS, typename X>
constexpr int position(int t) {
  if (BITS == 4) return t & 1 ? 16 + t / 2 : t / 2;
  if (sizeof(X) == 1 && BITS != 8) {
    const int g = t / 8;
    return (g == 1 ? 2 : g == 2 ? 1 : g) * 8 + t % 8;
  }
  return t;
}

template <typename X>
struct Staged {
  std::vector<typename Held<X>::type> q;  // (M, blocks, 32 * parts): high halves, then low
  std::vector<float> d, sums;             // d (M, blocks): x's scale a block; sums (M, G)
  std::vector<float> offsets;             // int8: 128 * d * sum of the block's rounded x
  int blocks = 0;
};

inline float hmax8(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
}
inline float hsum8(__m256 v) {
  __m128 m = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_add_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_add_ss(m, _mm_shuffle_ps(m, m, 1)));
}

template <int BITS, typename X>
void stage(const Codes& c, const float* x, const std::vector<int64_t>& row_offset,
           int64_t col_stride, int M, Staged<X>& s) {
  constexpr float top = Held<X>::top;
  constexpr int per = kBlock * Held<X>::parts;
  const int K = c.K, G = K / c.group;
  s.blocks = K / kBlock;
  s.q.assign(static_cast<size_t>(M) * s.blocks * per, 0);
  s.d.assign(static_cast<size_t>(M) * s.blocks, 0.f);
  s.sums.assign(static_cast<size_t>(M) * G, 0.f);
  s.offsets.assign(static_cast<size_t>(M) * s.blocks, 0.f);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  alignas(32) float v[kBlock];
  alignas(32) int32_t r[kBlock];
  for (int m = 0; m < M; ++m) {
    for (int b = 0; b < s.blocks; ++b) {
      const float* src = x + row_offset[m] + b * kBlock * col_stride;
      if (col_stride == 1) {
        std::memcpy(v, src, sizeof v);
      } else {
        for (int t = 0; t < kBlock; ++t) v[t] = src[t * col_stride];
      }
      __m256 vmax = _mm256_setzero_ps(), vsum = _mm256_setzero_ps();
      for (int i = 0; i < kBlock; i += 8) {
        const __m256 e = _mm256_load_ps(v + i);
        vmax = _mm256_max_ps(vmax, _mm256_and_ps(e, abs_mask));
        vsum = _mm256_add_ps(vsum, e);
      }
      const float amax = hmax8(vmax);
      const __m256 k = _mm256_set1_ps(amax > 0.f ? top / amax : 0.f);
      // Rounded to nearest even; |x * k| <= top, so the narrowing never saturates (a NaN's
      // integer is garbage, but its d is NaN, so the product is NaN as the float path's).
      for (int i = 0; i < kBlock; i += 8)
        _mm256_store_si256(reinterpret_cast<__m256i*>(r + i),
                           _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_load_ps(v + i), k)));
      auto* q = s.q.data() + (static_cast<size_t>(m) * s.blocks + b) * per;
      int64_t rounded_sum = 0;  // 32 31-bit integers overflow an int32
      for (int t = 0; t < kBlock; ++t) {
        rounded_sum += r[t];
        if constexpr (Held<X>::parts == 2) {
          q[position<BITS, X>(t)] = static_cast<int16_t>(r[t] >> 15);
          q[kBlock + position<BITS, X>(t)] = static_cast<int16_t>(r[t] & 0x7fff);
        } else {
          q[position<BITS, X>(t)] = static_cast<X>(r[t]);
        }
      }
      s.d[static_cast<size_t>(m) * s.blocks + b] = amax / top;
      s.offsets[static_cast<size_t>(m) * s.blocks + b] =
          128.f * (amax / top) * static_cast<float>(rounded_sum);
      s.sums[static_cast<size_t>(m) * G + b * kBlock / c.group] += hsum8(vsum);
    }
  }
}

// A block's codes as 32 bytes in position<BITS, int8_t>'s order (8 bits: offset to int8).
template <int BITS>
inline __m256i byte_codes(const uint8_t* w, const uint8_t* end) {
  if constexpr (BITS == 4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    const __m128i mask = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), mask), _mm_and_si128(b, mask));
  } else if constexpr (BITS == 8) {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)),
                            _mm256_set1_epi8(static_cast<char>(0x80)));
  } else {
    return _mm256_packus_epi16(half_codes<BITS>(w, end), half_codes<BITS>(w + 2 * BITS, end));
  }
}

// A block's codes as two registers of 16-bit lanes, in position<BITS, int16_t>'s order.
template <int BITS>
inline void word_codes(const uint8_t* w, const uint8_t* end, __m256i& c0, __m256i& c1) {
  if constexpr (BITS == 4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    const __m128i mask = _mm_set1_epi8(0x0f);
    c0 = _mm256_cvtepu8_epi16(_mm_and_si128(b, mask));
    c1 = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), mask));
  } else if constexpr (BITS == 8) {
    c0 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
    c1 = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16)));
  } else {
    c0 = half_codes<BITS>(w, end);
    c1 = half_codes<BITS>(w + 2 * BITS, end);
  }
}

template <int BITS, int MB, typename X>
void rows(const Codes& c, const Staged<X>& s, int m0, float* y, int n0, int n1) {
  constexpr int per = kBlock * Held<X>::parts;
  constexpr bool offset = sizeof(X) == 1 && BITS == 8;  // codes held as q - 128
  const int K = c.K, G = K / c.group, N = c.N, blocks = s.blocks;
  const int shift = c.group == 32 ? 0 : (c.group == 64 ? 1 : 2);  // block -> group
  const size_t row_bytes = static_cast<size_t>(K) * BITS / 8;
  const uint8_t* const end = c.w + static_cast<size_t>(N) * row_bytes;
  const auto* const xq = s.q.data() + static_cast<size_t>(m0) * blocks * per;
  const float* const xd = s.d.data() + static_cast<size_t>(m0) * blocks;
  const float* const xs = s.sums.data() + static_cast<size_t>(m0) * G;
  const __m256i ones = _mm256_set1_epi16(1);
  RowParams params(c, n0, n1);
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wn = c.w + n * row_bytes;
    const auto [sn, bn] = params.at(n);
    prefetch_row(c, n, n1, row_bytes);
    __m256 acc[MB];
    float fix[MB] = {};  // the offset codes' 128 * sum(x) a row
    for (int m = 0; m < MB; ++m) acc[m] = _mm256_setzero_ps();
    for (int blk = 0; blk < blocks; ++blk) {
      const uint8_t* wb = wn + blk * (kBlock * BITS / 8);
      const float sw = sn[blk >> shift];
      [[maybe_unused]] __m256i cb, c0, c1, cabs;
      if constexpr (sizeof(X) == 1) {
        cb = byte_codes<BITS>(wb, end);
        if constexpr (offset) cabs = _mm256_abs_epi8(cb);
      } else {
        word_codes<BITS>(wb, end, c0, c1);
      }
      for (int m = 0; m < MB; ++m) {
        const auto* xm = xq + (static_cast<size_t>(m) * blocks + blk) * per;
        const auto load = [&](int at) {
          return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xm + at));
        };
        __m256 sums;
        if constexpr (offset) {  // |codes| times x with the codes' signs: within int16
          fix[m] += sw * s.offsets[static_cast<size_t>(m0 + m) * blocks + blk];
          sums = _mm256_cvtepi32_ps(
              _mm256_madd_epi16(_mm256_maddubs_epi16(cabs, _mm256_sign_epi8(load(0), cb)), ones));
        } else if constexpr (sizeof(X) == 1) {
          sums = _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(cb, load(0)), ones));
        } else {
          const auto dot = [&](int at) {
            return _mm256_add_epi32(_mm256_madd_epi16(c0, load(at)),
                                    _mm256_madd_epi16(c1, load(at + 16)));
          };
          if constexpr (Held<X>::parts == 2) {  // high * 2^15 + low
            sums = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot(0)), _mm256_set1_ps(32768.f),
                                   _mm256_cvtepi32_ps(dot(kBlock)));
          } else {
            sums = _mm256_cvtepi32_ps(dot(0));
          }
        }
        acc[m] = _mm256_fmadd_ps(sums, _mm256_set1_ps(sw * xd[static_cast<size_t>(m) * blocks + blk]),
                                 acc[m]);
      }
    }
    for (int m = 0; m < MB; ++m) {
      float bias = fix[m];
      for (int g = 0; g < G; ++g) bias += bn[g] * xs[static_cast<size_t>(m) * G + g];
      y[static_cast<size_t>(m) * N + n] = hsum8(acc[m]) + bias;
    }
  }
}

}  // namespace qx
#define QF_INT 1
#endif
#ifdef QF_VNNI
#define QF_INT 1
#endif

#ifdef QF_INT
namespace qx {

// Either instruction set's staging and rows (above), driven alike.
template <int BITS, typename X>
void few_rows(const Codes& c, const float* x, const std::vector<int64_t>& row_offset,
              int64_t col_stride, float* y, int M) {
  // The calling thread's staging, kept between calls: a decode step makes ~200 of them, and
  // fresh buffers each time cost glibc's consolidation of its free lists. The pool's threads
  // read it through this reference (a thread_local named in their lambda would be theirs).
  thread_local Staged<X> kept;
  Staged<X>& s = kept;
  stage<BITS>(c, x, row_offset, col_stride, M, s);
  in_passes(c.N, c.K, M, [&]<int MB>(int m, int n0, int n1) {
    rows<BITS, MB>(c, s, m, y + static_cast<size_t>(m) * c.N, n0, n1);
  });
}

template <typename X>
void products(const Codes& c, const float* x, const std::vector<int64_t>& row_offset,
              int64_t col_stride, float* y, int M) {
  with_bits(c.bits, [&]<int BITS>() { few_rows<BITS, X>(c, x, row_offset, col_stride, y, M); });
}

}  // namespace qx
#endif

template <int BITS>
void dequantize_rows(const Codes& c, int n0, int n1, float* out) {
  const int K = c.K, per = c.group / kBlock, G = K / c.group;
  const size_t row_bytes = static_cast<size_t>(K) * BITS / 8;
  const uint8_t* const end = c.w + static_cast<size_t>(c.N) * row_bytes;
  std::vector<float> params(2 * static_cast<size_t>(G));
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wn = c.w + n * row_bytes;
    float* on = out + static_cast<size_t>(n - n0) * K;
    const auto [sn, bn] = block_params(c, n, 1, params.data());
    for (int g = 0; g < G; ++g) {
      const vf s = splat(sn[g]);
      const vf b = splat(bn[g]);
      for (int j = 0; j < per; ++j) {
        const int blk = g * per + j;
        v16 f0, f1;
        block_floats_ordered<BITS>(wn + blk * (kBlock * BITS / 8), end, f0, f1);
        for (int k = 0; k < kParts; ++k) {
          store(on + blk * kBlock + k * W, f0.p[k] * s + b);
          store(on + blk * kBlock + 16 + k * W, f1.p[k] * s + b);
        }
      }
    }
  }
}

void dequantize_any(const Codes& c, int n0, int n1, float* out) {
  with_bits(c.bits, [&]<int BITS>() { dequantize_rows<BITS>(c, n0, n1, out); });
}

// cblas_sgemm as MLX calls it: a BLAS preloaded into the process (qfserve preloads OpenBLAS)
// is found first; else the one libmlx itself links, looked up through libmlx's handle (the
// extension modules are loaded with local symbols, so it is not in the global scope).
using Sgemm = void (*)(int, int, int, int, int, int, float, const float*, int, const float*, int,
                       float, float*, int);

Sgemm find_sgemm() {
  if (void* f = dlsym(RTLD_DEFAULT, "cblas_sgemm")) return reinterpret_cast<Sgemm>(f);
  Dl_info info;
  if (dladdr(reinterpret_cast<void*>(&mx::allocator::malloc), &info) && info.dli_fname) {
    if (void* handle = dlopen(info.dli_fname, RTLD_LAZY | RTLD_NOLOAD)) {
      void* f = dlsym(handle, "cblas_sgemm");
      dlclose(handle);
      if (f) return reinterpret_cast<Sgemm>(f);
    }
  }
  return nullptr;
}

Sgemm sgemm() {
  static const Sgemm f = find_sgemm();
  return f;
}

// y (M, N) = x (M, K) @ W.T, W dequantized a tile of rows at a time into one buffer.
void many_rows(const Codes& c, const float* x, const std::vector<int64_t>& row_offset,
               int64_t col_stride, float* y, int M) {
  const int K = c.K, N = c.N;
  std::vector<float> packed;  // x's rows contiguous, where they are not
  const bool contiguous = col_stride == 1 && [&] {
    for (int m = 0; m < M; ++m)
      if (row_offset[m] != row_offset[0] + static_cast<int64_t>(m) * K) return false;
    return true;
  }();
  const float* xa = x + (M ? row_offset[0] : 0);
  if (!contiguous) {
    packed.resize(static_cast<size_t>(M) * K);
    for (int m = 0; m < M; ++m)
      for (int k = 0; k < K; ++k) packed[static_cast<size_t>(m) * K + k] = x[row_offset[m] + k * col_stride];
    xa = packed.data();
  }
  // Tiles of up to kTileFloats: few enough sgemm calls that their start-up (the BLAS's threads
  // waking) stays small beside the product; a small model's weight is one tile.
  const int tile = std::max(16, std::min(N, static_cast<int>(kTileFloats / K) / 16 * 16));
  // Kept between calls (one per calling thread, at most kTileFloats): a fresh one would be
  // zeroed and page-faulted in on every product, about as long as dequantizing into it.
  static thread_local std::vector<float> buffer;
  if (buffer.size() < static_cast<size_t>(tile) * K) buffer.resize(static_cast<size_t>(tile) * K);
  float* const buf = buffer.data();  // the pool's threads must not name their own buffer
  Pool& p = pool();
  for (int n0 = 0; n0 < N; n0 += tile) {
    const int rows_here = std::min(tile, N - n0);
    const int chunks = std::max(1, std::min(rows_here / 16, p.threads()));
    const int per = (rows_here + chunks - 1) / chunks;
    p.run(chunks, [&](int chunk) {
      const int a = n0 + chunk * per, b = std::min(a + per, n0 + rows_here);
      if (a < b) dequantize_any(c, a, b, buf + static_cast<size_t>(a - n0) * K);
    });
    // Row-major, x as is, the tile transposed: y[:, n0:n0 + rows_here] (ldc N).
    sgemm()(101, 111, 112, M, rows_here, K, 1.f, xa, K, buf, K, 0.f, y + n0, N);
  }
}

}  // namespace

void qfserve::detail::quantized_rows(const Codes& c, const float* x,
                                     const std::vector<int64_t>& row_offset, int64_t col_stride,
                                     float* y, int M) {
  if (M > kFewRows && sgemm() != nullptr) return many_rows(c, x, row_offset, col_stride, y, M);
#ifdef QF_INT
  switch (activations_on.load(std::memory_order_relaxed)) {
    case 8:
      if (M <= qx::kRows8) return qx::products<int8_t>(c, x, row_offset, col_stride, y, M);
      break;
    case 16:
      if (M <= qx::kRows16) return qx::products<int16_t>(c, x, row_offset, col_stride, y, M);
      break;
    case 32:
      if (M <= qx::kRows32) return qx::products<int32_t>(c, x, row_offset, col_stride, y, M);
      break;
    default: break;
  }
#endif
  with_bits(c.bits, [&]<int BITS>() { few_rows<BITS>(c, x, row_offset, col_stride, y, M); });
}

bool qfserve::detail::integer_available() {
#ifdef QF_INT
  return true;
#else
  return false;
#endif
}

int qfserve::detail::integer_activations() {
  return integer_available() ? activations_on.load() : 0;
}

void qfserve::detail::set_integer_activations(int bits) {
  if (bits != 0 && bits != 8 && bits != 16 && bits != 32)
    throw std::invalid_argument("activations are 0 (float32), 8, 16 or 32 bits, not " +
                                std::to_string(bits));
  activations_on.store(bits);
}

void qfserve::detail::dequantize_codes(const Codes& c, float* out) {
  Pool& p = pool();
  const int chunks = std::max(1, std::min(c.N / 32, 4 * p.threads()));
  const int per = (c.N + chunks - 1) / chunks;
  p.run(chunks, [&](int chunk) {
    const int a = chunk * per, b = std::min(a + per, c.N);
    if (a < b) dequantize_any(c, a, b, out + static_cast<size_t>(a) * c.K);
  });
}

qfserve::detail::Codes qfserve::detail::codes_of(const mx::array& w, const mx::array& scales,
                                                 const mx::array& biases, int K) {
  const bool half = scales.dtype() == mx::float16;
  if (w.ndim() != 2 || scales.ndim() != 2 || biases.shape() != scales.shape() ||
      w.dtype() != mx::uint32 || (!half && scales.dtype() != mx::float32) ||
      biases.dtype() != scales.dtype() || scales.shape(0) != w.shape(0) || scales.shape(1) < 1)
    throw std::invalid_argument(
        "codes must be uint32 w (N, K * bits / 32) with scales and biases (N, groups), both "
        "float32 or both float16");
  const int64_t group = K / scales.shape(1);
  const int64_t bits = w.shape(1) * 32 / std::max(K, 1);
  if (K < 1 || group * scales.shape(1) != K || (group != 32 && group != 64 && group != 128))
    throw std::invalid_argument("the input's width " + std::to_string(K) +
                                " must be 32, 64 or 128 times the scales' groups (" +
                                std::to_string(scales.shape(1)) + ")");
  if ((bits != 4 && bits != 5 && bits != 6 && bits != 8) || w.shape(1) * 32 != K * bits)
    throw std::invalid_argument("codes of 4, 5, 6 or 8 bits: w has " +
                                std::to_string(w.shape(1)) + " words a row for width " +
                                std::to_string(K));
  return {nullptr, nullptr, nullptr, static_cast<int>(bits), static_cast<int>(group),
          static_cast<int>(w.shape(0)), K, half};
}

qfserve::detail::Codes qfserve::detail::bind(Codes c, const mx::array& w,
                                             const mx::array& scales, const mx::array& biases) {
  c.w = w.data<uint8_t>();
  c.scales = scales.data<void>();
  c.biases = biases.data<void>();
  return c;
}

namespace {

void start(mx::Stream stream, const std::vector<mx::array>& inputs, mx::array& out) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& a : inputs) encoder.set_input_array(a);
  encoder.set_output_array(out);
}

// The MLX primitive: inputs x (..., K) float32 (any strides), w, scales and biases
// row-contiguous; output (..., N) float32. Taking any leading shape and strides saves the
// reshape and copy ops around each call (a decode step makes ~200 calls, and each MLX op
// costs microseconds on the CPU).
class QuantizedMatmul : public mx::UnaryPrimitive {
 public:
  QuantizedMatmul(mx::Stream stream, Codes codes) : mx::UnaryPrimitive(stream), codes_(codes) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    start(stream(), inputs, out);
    const Codes c = qfserve::detail::bind(codes_, inputs[1], inputs[2], inputs[3]);
    const int M = static_cast<int>(x.size() / c.K);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.dispatch([x_ptr = x.data<float>(), y_ptr = out.data<float>(),
                      row_offset = qfserve::row_starts(x), col_stride = x.strides().back(), c,
                      M]() {
      qfserve::detail::quantized_rows(c, x_ptr, row_offset, col_stride, y_ptr, M);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("qfserve's quantized matmul runs on the CPU only");
  }

  const char* name() const override { return "QfserveQuantizedMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const Codes& o = static_cast<const QuantizedMatmul&>(other).codes_;
    return codes_.bits == o.bits && codes_.group == o.group && codes_.half == o.half;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  Codes codes_;  // the layout; pointers bound at each evaluation
};

class Dequantize : public mx::UnaryPrimitive {
 public:
  Dequantize(mx::Stream stream, Codes codes) : mx::UnaryPrimitive(stream), codes_(codes) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    start(stream(), inputs, out);
    const Codes c = qfserve::detail::bind(codes_, inputs[0], inputs[1], inputs[2]);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.dispatch(
        [c, y_ptr = out.data<float>()]() { qfserve::detail::dequantize_codes(c, y_ptr); });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("qfserve's dequantize runs on the CPU only");
  }

  const char* name() const override { return "QfserveDequantize"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const Codes& o = static_cast<const Dequantize&>(other).codes_;
    return codes_.bits == o.bits && codes_.group == o.group && codes_.K == o.K &&
           codes_.half == o.half;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0), codes_.K}};
  }

 private:
  Codes codes_;
};

// Weights are loaded arrays, contiguous already: a copy op only for one that is not.
mx::array row_contiguous(const mx::array& a, mx::Stream stream) {
  return a.is_available() && a.flags().row_contiguous ? a : mx::contiguous(a, false, stream);
}

int width(int64_t words, int bits) { return static_cast<int>(words * 32 / std::max(bits, 1)); }

}  // namespace

namespace qfserve {

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int bits, mx::StreamOrDevice s) {
  if (x.ndim() < 1 || x.dtype() != mx::float32)
    throw std::invalid_argument("x must be float32 with at least one axis");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  std::vector<mx::array> inputs = {x, row_contiguous(w, stream), row_contiguous(scales, stream),
                                   row_contiguous(biases, stream)};
  const int K = static_cast<int>(x.shape(-1));
  const Codes codes = detail::codes_of(inputs[1], inputs[2], inputs[3], K);
  if (codes.bits != bits)
    throw std::invalid_argument("bits is " + std::to_string(bits) + " but the codes are " +
                                std::to_string(codes.bits) + "-bit for x's width " +
                                std::to_string(K));
  mx::Shape shape = x.shape();
  shape.back() = codes.N;
  return mx::array(std::move(shape), mx::float32,
                   std::make_shared<QuantizedMatmul>(stream, codes), std::move(inputs));
}

mx::array dequantize(const mx::array& w, const mx::array& scales, const mx::array& biases,
                     int bits, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s, mx::Device::cpu);
  std::vector<mx::array> inputs = {row_contiguous(w, stream), row_contiguous(scales, stream),
                                   row_contiguous(biases, stream)};
  if (w.ndim() != 2) throw std::invalid_argument("w must be 2-D");
  const Codes codes = detail::codes_of(inputs[0], inputs[1], inputs[2], width(w.shape(1), bits));
  if (codes.bits != bits) throw std::invalid_argument("bits must be 4, 5, 6 or 8");
  return mx::array({codes.N, codes.K}, mx::float32, std::make_shared<Dequantize>(stream, codes),
                   std::move(inputs));
}

}  // namespace qfserve
