// A CPU matrix product for weights that stay quantized: MLX's affine layout (group size 32,
// 4 or 8 bits, which is what the GGUF formats Q4_0 / Q4_1 / Q8_0 load as), float32
// activations, float32 scales and biases.
//
// Why by hand: MLX's own CPU quantized_matmul is several times slower than a float32 matrix
// product on the same weights (it is written for Metal first), so on the CPU the served
// weights had to be dequantized to float32, and a decode step then reads ~540 MB of them for
// SmolLM2-135M. This kernel reads the quantized bytes (~100 MB), unpacks them in registers
// and accumulates in float32, on a small pool of its own threads.
//
//   y[m, n] = sum_g scale[n, g] * (q[n, g, :] . x[m, g, :]) + bias[n, g] * sum(x[m, g, :])
//
// The dot of one group's codes with x runs in float32 with AVX2 FMAs, one vector
// accumulator per row of x; the bias term uses the group sums of x, computed once per call.
// It is meant for few rows of x (decode: one row per sequence); the Python side sends long
// prompts to a dequantized float32 product, where a BLAS is faster.

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define QF_AVX2 1
#endif

#include "detail.h"
#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "pool.h"

namespace mx = mlx::core;
using qfserve::Pool;
using qfserve::pool;

namespace {

constexpr int kGroup = 32;

// ---------------------------------------------------------------------------------------
// The kernel. x is permuted per group for 4 bits so that a byte's low nibbles meet the even
// elements and its high nibbles the odd ones (MLX packs element j of a word at bits 4j).

#ifdef QF_AVX2
inline float hsum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}

inline __m256 widen(__m128i bytes) {  // the low 8 bytes as 8 floats
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
}

// One group's codes as four vectors of 8 floats, in the order the (permuted) x is stored.
template <int BITS>
inline void unpack(const uint8_t* w, __m256 (&f)[4]) {
  if constexpr (BITS == 4) {
    const __m128i mask = _mm_set1_epi8(0x0f);
    __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    __m128i lo = _mm_and_si128(bytes, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
    f[0] = widen(lo);
    f[1] = widen(_mm_srli_si128(lo, 8));
    f[2] = widen(hi);
    f[3] = widen(_mm_srli_si128(hi, 8));
  } else {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + 16));
    f[0] = widen(a);
    f[1] = widen(_mm_srli_si128(a, 8));
    f[2] = widen(b);
    f[3] = widen(_mm_srli_si128(b, 8));
  }
}

template <int BITS, int MB>
void rows_avx2(const uint8_t* w, const float* scales, const float* biases, const float* xp,
               const float* xs, float* y, int N, int K, int n0, int n1) {
  const int G = K / kGroup;
  const int row_bytes = K * BITS / 8;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wn = w + static_cast<size_t>(n) * row_bytes;
    const float* sn = scales + static_cast<size_t>(n) * G;
    const float* bn = biases + static_cast<size_t>(n) * G;
    __m256 acc[MB];
    float bias_sum[MB];
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm256_setzero_ps();
      bias_sum[m] = 0.f;
    }
    for (int g = 0; g < G; ++g) {
      __m256 f[4];
      unpack<BITS>(wn + g * (kGroup * BITS / 8), f);
      const __m256 s = _mm256_broadcast_ss(sn + g);
      for (int m = 0; m < MB; ++m) {
        const float* xg = xp + static_cast<size_t>(m) * K + g * kGroup;
        __m256 d = _mm256_mul_ps(f[0], _mm256_loadu_ps(xg));
        d = _mm256_fmadd_ps(f[1], _mm256_loadu_ps(xg + 8), d);
        d = _mm256_fmadd_ps(f[2], _mm256_loadu_ps(xg + 16), d);
        d = _mm256_fmadd_ps(f[3], _mm256_loadu_ps(xg + 24), d);
        acc[m] = _mm256_fmadd_ps(d, s, acc[m]);
        bias_sum[m] += bn[g] * xs[static_cast<size_t>(m) * G + g];
      }
    }
    for (int m = 0; m < MB; ++m) y[static_cast<size_t>(m) * N + n] = hsum(acc[m]) + bias_sum[m];
  }
}
#endif

#ifdef __AVX512F__
// The same with 16 lanes: a group is two vectors, one widening (vpmovzxbd) per 16 codes.
template <int BITS, int MB>
void rows_avx512(const uint8_t* w, const float* scales, const float* biases, const float* xp,
                 const float* xs, float* y, int N, int K, int n0, int n1) {
  const int G = K / kGroup;
  const int row_bytes = K * BITS / 8;
  const __m512i mask = _mm512_set1_epi32(0x0f);
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wn = w + static_cast<size_t>(n) * row_bytes;
    const float* sn = scales + static_cast<size_t>(n) * G;
    const float* bn = biases + static_cast<size_t>(n) * G;
    __m512 acc[MB];
    float bias_sum[MB];
    for (int m = 0; m < MB; ++m) {
      acc[m] = _mm512_setzero_ps();
      bias_sum[m] = 0.f;
    }
    for (int g = 0; g < G; ++g) {
      const uint8_t* wg = wn + g * (kGroup * BITS / 8);
      __m512 f0, f1;
      if constexpr (BITS == 4) {  // lanes: byte i's low nibble (x[2i]), then its high one
        __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg)));
        f0 = _mm512_cvtepi32_ps(_mm512_and_si512(v, mask));
        f1 = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
      } else {
        f0 = _mm512_cvtepi32_ps(
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg))));
        f1 = _mm512_cvtepi32_ps(
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wg + 16))));
      }
      const __m512 s = _mm512_set1_ps(sn[g]);
      for (int m = 0; m < MB; ++m) {
        const float* xg = xp + static_cast<size_t>(m) * K + g * kGroup;
        __m512 d = _mm512_mul_ps(f0, _mm512_loadu_ps(xg));
        d = _mm512_fmadd_ps(f1, _mm512_loadu_ps(xg + 16), d);
        acc[m] = _mm512_fmadd_ps(d, s, acc[m]);
        bias_sum[m] += bn[g] * xs[static_cast<size_t>(m) * G + g];
      }
    }
    for (int m = 0; m < MB; ++m)
      y[static_cast<size_t>(m) * N + n] = _mm512_reduce_add_ps(acc[m]) + bias_sum[m];
  }
}
#endif

// Portable version: the same arithmetic, one element at a time.
template <int BITS, int MB>
void rows_scalar(const uint8_t* w, const float* scales, const float* biases, const float* xp,
                 const float* xs, float* y, int N, int K, int n0, int n1) {
  const int G = K / kGroup;
  const int row_bytes = K * BITS / 8;
  for (int n = n0; n < n1; ++n) {
    const uint8_t* wn = w + static_cast<size_t>(n) * row_bytes;
    for (int m = 0; m < MB; ++m) {
      const float* xm = xp + static_cast<size_t>(m) * K;
      float total = 0.f;
      for (int g = 0; g < G; ++g) {
        const uint8_t* wg = wn + g * (kGroup * BITS / 8);
        float dot = 0.f;
        for (int t = 0; t < kGroup; ++t) {
          int q;
          if constexpr (BITS == 4) {  // permuted x: low nibbles first, then high
            q = t < 16 ? (wg[t] & 0x0f) : (wg[t - 16] >> 4);
          } else {
            q = wg[t];
          }
          dot += static_cast<float>(q) * xm[g * kGroup + t];
        }
        total += scales[static_cast<size_t>(n) * G + g] * dot +
                 biases[static_cast<size_t>(n) * G + g] * xs[static_cast<size_t>(m) * G + g];
      }
      y[static_cast<size_t>(m) * N + n] = total;
    }
  }
}

template <int BITS, int MB>
void rows(const uint8_t* w, const float* s, const float* b, const float* xp, const float* xs,
          float* y, int N, int K, int n0, int n1) {
#if defined(__AVX512F__)
  rows_avx512<BITS, MB>(w, s, b, xp, xs, y, N, K, n0, n1);
#elif defined(QF_AVX2)
  rows_avx2<BITS, MB>(w, s, b, xp, xs, y, N, K, n0, n1);
#else
  rows_scalar<BITS, MB>(w, s, b, xp, xs, y, N, K, n0, n1);
#endif
}

// x's rows may be strided (a transposed or sliced view): row m's element k is at
// x + row_offset[m] + k * col_stride.
template <int BITS>
void matmul(const uint8_t* w, const float* s, const float* b, const float* x,
            const std::vector<int64_t>& row_offset, int64_t col_stride, float* y, int M, int N,
            int K) {
  const int G = K / kGroup;
  // Permute x for 4 bits and take the group sums, once for every output row.
  std::vector<float> xp(static_cast<size_t>(M) * K);
  std::vector<float> xs(static_cast<size_t>(M) * G);
  for (int m = 0; m < M; ++m) {
    for (int g = 0; g < G; ++g) {
      const float* src = x + row_offset[m] + g * kGroup * col_stride;
      float* dst = xp.data() + static_cast<size_t>(m) * K + g * kGroup;
      float sum = 0.f;
      for (int t = 0; t < kGroup; ++t) {
        const float v = src[t * col_stride];
        sum += v;
        if constexpr (BITS == 4) {
          dst[(t & 1) ? 16 + t / 2 : t / 2] = v;
        } else {
          dst[t] = v;
        }
      }
      xs[static_cast<size_t>(m) * G + g] = sum;
    }
  }
  // Chunks of at least 32 rows, about four per thread, so a late or busy thread costs little.
  Pool& p = pool();
  // Below ~256k multiply-adds (tens of microseconds) one thread is faster than waking another.
  const bool split = static_cast<int64_t>(N) * K * M >= (int64_t{1} << 18);
  const int chunks = split ? std::max(1, std::min(N / 32, 4 * p.threads())) : 1;
  const int per = (N + chunks - 1) / chunks;
  p.run(chunks, [&](int chunk) {
    const int n0 = chunk * per;
    const int n1 = std::min(n0 + per, N);
    int m = 0;
    for (; m + 4 <= M; m += 4)
      rows<BITS, 4>(w, s, b, xp.data() + static_cast<size_t>(m) * K,
                    xs.data() + static_cast<size_t>(m) * G, y + static_cast<size_t>(m) * N, N,
                    K, n0, n1);
    for (; m < M; ++m)
      rows<BITS, 1>(w, s, b, xp.data() + static_cast<size_t>(m) * K,
                    xs.data() + static_cast<size_t>(m) * G, y + static_cast<size_t>(m) * N, N,
                    K, n0, n1);
  });
}

}  // namespace

void qfserve::detail::quantized_rows(const uint8_t* w, const float* scales, const float* biases,
                                     int bits, const float* x,
                                     const std::vector<int64_t>& row_offset, int64_t col_stride,
                                     float* y, int M, int N, int K) {
  if (bits == 4)
    matmul<4>(w, scales, biases, x, row_offset, col_stride, y, M, N, K);
  else
    matmul<8>(w, scales, biases, x, row_offset, col_stride, y, M, N, K);
}

namespace {

// ---------------------------------------------------------------------------------------
// The MLX primitive: inputs x (..., K) float32 (any strides), w (N, K*bits/32) uint32,
// scales and biases (N, K/32) float32, row-contiguous; output (..., N) float32. Taking any
// leading shape and strides saves the reshape and copy ops around each call (a decode step
// makes ~200 calls, and each MLX op costs microseconds on the CPU).
class QuantizedMatmul : public mx::UnaryPrimitive {
 public:
  QuantizedMatmul(mx::Stream stream, int bits) : mx::UnaryPrimitive(stream), bits_(bits) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    const mx::array& s = inputs[2];
    const mx::array& b = inputs[3];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_input_array(s);
    encoder.set_input_array(b);
    encoder.set_output_array(out);
    const int K = static_cast<int>(x.shape(-1));
    const int M = static_cast<int>(x.size() / K);
    const int N = static_cast<int>(w.shape(0));
    // Each row's offset from the strides of x's leading axes.
    std::vector<int64_t> row_offset(M);
    for (int m = 0; m < M; ++m) {
      int64_t rest = m, offset = 0;
      for (int axis = static_cast<int>(x.ndim()) - 2; axis >= 0; --axis) {
        offset += (rest % x.shape(axis)) * x.strides()[axis];
        rest /= x.shape(axis);
      }
      row_offset[m] = offset;
    }
    const int64_t col_stride = x.strides().back();
    const int bits = bits_;
    encoder.dispatch([x_ptr = x.data<float>(), w_ptr = w.data<uint8_t>(),
                      s_ptr = s.data<float>(), b_ptr = b.data<float>(),
                      y_ptr = out.data<float>(), row_offset = std::move(row_offset), col_stride,
                      M, N, K, bits]() {
      qfserve::detail::quantized_rows(w_ptr, s_ptr, b_ptr, bits, x_ptr, row_offset, col_stride,
                                      y_ptr, M, N, K);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("qfserve's quantized matmul runs on the CPU only");
  }

  const char* name() const override { return "QfserveQuantizedMatmul"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return bits_ == static_cast<const QuantizedMatmul&>(other).bits_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    mx::Shape shape = inputs[0].shape();
    shape.back() = inputs[1].shape(0);
    return {shape};
  }

 private:
  int bits_;
};

// Weights are loaded arrays, contiguous already: a copy op only for one that is not.
mx::array row_contiguous(const mx::array& a, mx::Stream stream) {
  return a.is_available() && a.flags().row_contiguous ? a : mx::contiguous(a, false, stream);
}

}  // namespace

namespace qfserve {

mx::array quantized_matmul(const mx::array& x, const mx::array& w, const mx::array& scales,
                           const mx::array& biases, int bits, mx::StreamOrDevice s) {
  if (bits != 4 && bits != 8) throw std::invalid_argument("bits must be 4 or 8");
  if (x.ndim() < 1 || w.ndim() != 2 || scales.ndim() != 2 || biases.ndim() != 2)
    throw std::invalid_argument("x must have an axis, and w, scales and biases be 2-D");
  const int K = static_cast<int>(x.shape(-1));
  const int N = static_cast<int>(w.shape(0));
  if (K % kGroup != 0 || w.shape(1) * 32 != K * bits || scales.shape(0) != N ||
      scales.shape(1) != K / kGroup || biases.shape() != scales.shape())
    throw std::invalid_argument("shapes do not match a group-32 quantized weight");
  if (x.dtype() != mx::float32 || scales.dtype() != mx::float32 ||
      biases.dtype() != mx::float32 || w.dtype() != mx::uint32)
    throw std::invalid_argument("x, scales and biases must be float32 and w uint32");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  mx::Shape shape = x.shape();
  shape.back() = N;
  std::vector<mx::array> inputs = {x, row_contiguous(w, stream), row_contiguous(scales, stream),
                                   row_contiguous(biases, stream)};
  return mx::array(std::move(shape), mx::float32,
                   std::make_shared<QuantizedMatmul>(stream, bits), std::move(inputs));
}

}  // namespace qfserve
