// The kernels' inner routines on raw pointers, shared by their own ops and by the fused decode
// ops of decode_block.cpp, which run several of them in one dispatch with the same arithmetic.
#pragma once

#include <cstdint>
#include <vector>

#include "mlx/array.h"

namespace qfserve::detail {

// A weight (N, K) in MLX's affine layout: bits 4, 5, 6 or 8, groups of 32, 64 or 128,
// scales and biases (N, K / group) both float32 or both float16 (`half`), row-contiguous
// (quantized_matmul.cpp).
struct Codes {
  const uint8_t* w;
  const void* scales;
  const void* biases;
  int bits, group, N, K;
  bool half;
};

// The layout of (w, scales, biases) for an input of width K (pointers unset), checked;
// std::invalid_argument naming what does not fit.
Codes codes_of(const mlx::core::array& w, const mlx::core::array& scales,
               const mlx::core::array& biases, int K);
// The layout with the evaluated arrays' pointers.
Codes bind(Codes c, const mlx::core::array& w, const mlx::core::array& scales,
           const mlx::core::array& biases);

// y (M, N) = x (M rows, each at x + row_offset[m], elements col_stride apart) @ the
// dequantized weight (N, K).T: in registers for few rows, a tile at a time through the
// BLAS for more.
void quantized_rows(const Codes& c, const float* x, const std::vector<int64_t>& row_offset,
                    int64_t col_stride, float* y, int M);

// The bits few-row products round x to (AVX-512 VNNI; quantized_matmul.cpp): 32 by default,
// 16, 8, or 0 for float32; one setting for the whole process, 0 where the CPU lacks VNNI.
bool integer_available();
int integer_activations();
void set_integer_activations(int bits);

// The weight dequantized, (N, K) float32 row-major.
void dequantize_codes(const Codes& c, float* out);

// RoPE of x (B, H, T, D) read through its strides into out, contiguous (rope.cpp).
struct RopeLayout {
  int B, H, T, D, dims;
  int64_t x_b, x_h, x_t, x_d, inv_s, off_b;  // off_b: 0 for one offset, else its stride
  bool traditional;
  float scale;
};
void rope_rows(const float* x, const float* inv_freqs, const int32_t* offset, float* out,
               const RopeLayout& layout);

// out = x * rsqrt(mean(x^2) + eps) * weight over n contiguous floats (pointwise.cpp).
void rms_row(const float* x, const float* weight, float* out, int n, float eps);

// out[i] = g[i] * sigmoid(g[i]) * u[i] over n contiguous floats (pointwise.cpp).
void swiglu_row(const float* g, const float* u, float* out, int n);

// out[i] = gelu_approx(g[i]) * u[i] over n contiguous floats, gelu_approx(x) = 0.5 x (1 +
// tanh(sqrt(2 / pi) (x + 0.044715 x^3))) as MLX's nn.gelu_approx (Gemma's MLP; pointwise.cpp).
void gelu_glu_row(const float* g, const float* u, float* out, int n);

}  // namespace qfserve::detail
