// 16-float vectors for qfserve's native kernels: GCC's vector extensions, one AVX-512
// register (two AVX2 ones) under -march=native, and the few vector functions they share.
#pragma once

#include <cstdint>

namespace qfserve::simd {

// GCC's vector extensions: 16 floats, one AVX-512 register (two AVX2 ones) under -march=native.
constexpr int W = 16;
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef float vf_unaligned __attribute__((vector_size(W * 4), aligned(4)));

inline vf load(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }
inline void store(float* p, vf v) { *reinterpret_cast<vf_unaligned*>(p) = v; }
inline vf splat(float x) { return vf{} + x; }
inline vf vmax(vf a, vf b) { return a > b ? a : b; }

// Horizontal max and sum: halve the vector four times.
inline float hmax(vf v) {
  v = vmax(v, __builtin_shuffle(v, vi{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7}));
  v = vmax(v, __builtin_shuffle(v, vi{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11}));
  v = vmax(v, __builtin_shuffle(v, vi{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13}));
  v = vmax(v, __builtin_shuffle(v, vi{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14}));
  return v[0];
}
inline float hsum(vf v) {
  v += __builtin_shuffle(v, vi{8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7});
  v += __builtin_shuffle(v, vi{4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11});
  v += __builtin_shuffle(v, vi{2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13});
  v += __builtin_shuffle(v, vi{1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14});
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
