// Float vectors of the CPU's own width for qfserve's native kernels (GCC's vector extensions
// under -march=native), and the few vector functions they share.
//
// W is the widest register the CPU has: 16 floats with AVX-512, 8 with AVX2, 4 otherwise
// (SSE, NEON). Why not 16 everywhere: a vector wider than the CPU's registers has no machine
// mode, so GCC keeps it in memory and moves it through general registers (on AVX2 a
// quantized product ran at 3-7 GFLOP/s, a tenth of what its own ymm arithmetic does).
#pragma once

#include <cstdint>

namespace qfserve::simd {

#if defined(__AVX512F__)
constexpr int W = 16;
#elif defined(__AVX__)
constexpr int W = 8;
#else
constexpr int W = 4;
#endif
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef float vf_unaligned __attribute__((vector_size(W * 4), aligned(4)));

inline vf load(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }
inline void store(float* p, vf v) { *reinterpret_cast<vf_unaligned*>(p) = v; }
inline vf splat(float x) { return vf{} + x; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// v with its halves, quarters, ... swapped: step s exchanges lanes i and i ^ s.
template <int S>
inline vf swapped(vf v) {
#if defined(__AVX512F__)
  if constexpr (S == 8) return __builtin_shuffle(v, vi{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  if constexpr (S == 4) return __builtin_shuffle(v, vi{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  if constexpr (S == 2) return __builtin_shuffle(v, vi{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  return __builtin_shuffle(v, vi{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
#elif defined(__AVX__)
  if constexpr (S == 4) return __builtin_shuffle(v, vi{4, 5, 6, 7, 0, 1, 2, 3});
  if constexpr (S == 2) return __builtin_shuffle(v, vi{2, 3, 0, 1, 6, 7, 4, 5});
  return __builtin_shuffle(v, vi{1, 0, 3, 2, 5, 4, 7, 6});
#else
  if constexpr (S == 2) return __builtin_shuffle(v, vi{2, 3, 0, 1});
  return __builtin_shuffle(v, vi{1, 0, 3, 2});
#endif
}

// Horizontal max and sum: halve the vector until one lane holds the result.
inline float hmax(vf v) {
  if constexpr (W >= 16) v = vmax(v, swapped<8>(v));
  if constexpr (W >= 8) v = vmax(v, swapped<4>(v));
  v = vmax(v, swapped<2>(v));
  v = vmax(v, swapped<1>(v));
  return v[0];
}
inline float hsum(vf v) {
  if constexpr (W >= 16) v += swapped<8>(v);
  if constexpr (W >= 8) v += swapped<4>(v);
  v += swapped<2>(v);
  v += swapped<1>(v);
  return v[0];
}

// exp(x), about 1 ulp: 0 below -87 (and for -inf), clamped at 88 above. Cephes' expf:
// x = n ln2 + r, |r| <= ln2 / 2, a degree-6 polynomial in r, times 2^n built in the exponent.
inline vf vexp(vf x) {
  const vf lo = splat(-87.0f), hi = splat(88.0f);
  const vi dead = x < lo;
  x = dead ? lo : x;
  x = x > hi ? hi : x;
  const vf magic = splat(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer
  vf n = x * 1.44269504088896341f + magic;
  const vi ni = (vi)n - 0x4B400000;
  n = n - magic;
  const vf r = x - n * 0.693359375f + n * 2.12194440e-4f;
  vf p = splat(1.9875691500e-4f);
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const vf y = p * (vf)((ni + 127) << 23);
  return dead ? vf{} : y;
}

}  // namespace qfserve::simd
