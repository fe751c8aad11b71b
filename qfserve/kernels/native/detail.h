// The kernels' inner routines on raw pointers, shared by their own ops and by the fused decode
// ops of decode_block.cpp, which run several of them in one dispatch with the same arithmetic.
#pragma once

#include <cstdint>
#include <vector>

namespace qfserve::detail {

// y (M, N) = x (M rows, each at x + row_offset[m], elements col_stride apart) @ the
// dequantized group-32 weight (N, K).T; bits 4 or 8 (quantized_matmul.cpp).
void quantized_rows(const uint8_t* w, const float* scales, const float* biases, int bits,
                    const float* x, const std::vector<int64_t>& row_offset, int64_t col_stride,
                    float* y, int M, int N, int K);

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

}  // namespace qfserve::detail
