// Rotary position embedding (RoPE) of queries or keys, on the CPU, as mx.fast.rope computes it.
//
// Why by hand: MLX has no CPU kernel for mx.fast.rope; on the CPU it runs its fallback, about
// twenty small ops (positions, frequencies, cos, sin, slices, products, a concatenation), each
// dispatched and evaluated on its own: ~115 us a call on this machine, where a decode step of
// SmolLM2-135M makes 60 of them (7 ms of a ~34 ms step). Here it is one op.
//
// The arithmetic is the fallback's, in float32: with half = dims / 2 and inv_freqs given (the
// caller computes them with MLX, so they are the fallback's own),
//   theta[t, i] = ((t + offset[b]) * scale) * inv_freqs[i]
//   (x1, x2) -> (x1 cos - x2 sin, x1 sin + x2 cos)
// where x1, x2 are x[i], x[i + half] (or x[2i], x[2i + 1] when traditional); the dimensions
// past dims are copied. Products and sums are not fused (no FMA), as the fallback's are not.

#include <cmath>
#include <cstdint>
#include <vector>

#include "detail.h"
#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "pool.h"

namespace mx = mlx::core;

namespace {

using Layout = qfserve::detail::RopeLayout;

// One (sequence, position): its cos and sin once, then every head.
__attribute__((optimize("fp-contract=off"))) void rotate(const float* x, const float* inv,
                                                         const int32_t* offset, float* out,
                                                         const Layout& L, int b, int t,
                                                         std::vector<float>& cs) {
  const int half = L.dims / 2;
  cs.resize(2 * half);
  const float pos = static_cast<float>(t + offset[b * L.off_b]) * L.scale;
  for (int i = 0; i < half; ++i) {
    const float theta = pos * inv[i * L.inv_s];
    cs[i] = std::cos(theta);
    cs[half + i] = std::sin(theta);
  }
  for (int h = 0; h < L.H; ++h) {
    const float* xr = x + b * L.x_b + h * L.x_h + t * L.x_t;
    float* o = out + ((static_cast<int64_t>(b) * L.H + h) * L.T + t) * L.D;
    const int step = L.traditional ? 2 : 1, second = L.traditional ? 1 : half;
    for (int i = 0; i < half; ++i) {
      const int j1 = i * step, j2 = j1 + second;
      const float x1 = xr[j1 * L.x_d], x2 = xr[j2 * L.x_d];
      const float c = cs[i], s = cs[half + i];
      const float a = x1 * c, bb = x2 * s, cc = x1 * s, d = x2 * c;
      o[j1] = a - bb;
      o[j2] = cc + d;
    }
    for (int j = L.dims; j < L.D; ++j) o[j] = xr[j * L.x_d];
  }
}

class Rope : public mx::UnaryPrimitive {
 public:
  Rope(mx::Stream stream, int dims, bool traditional, float scale)
      : mx::UnaryPrimitive(stream), dims_(dims), traditional_(traditional), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    const mx::array& inv = inputs[1];
    const mx::array& offset = inputs[2];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    encoder.set_output_array(out);
    Layout L{static_cast<int>(x.shape(0)), static_cast<int>(x.shape(1)),
             static_cast<int>(x.shape(2)), static_cast<int>(x.shape(3)), dims_,
             x.strides()[0], x.strides()[1], x.strides()[2], x.strides()[3],
             inv.strides()[0], offset.ndim() == 1 && offset.size() > 1 ? offset.strides()[0] : 0,
             traditional_, scale_};
    encoder.dispatch([x_ptr = x.data<float>(), inv_ptr = inv.data<float>(),
                      off_ptr = offset.data<int32_t>(), o_ptr = out.data<float>(), L]() {
      qfserve::detail::rope_rows(x_ptr, inv_ptr, off_ptr, o_ptr, L);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("qfserve's rope runs on the CPU only");
  }

  const char* name() const override { return "QfserveRope"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Rope&>(other);
    return dims_ == o.dims_ && traditional_ == o.traditional_ && scale_ == o.scale_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  int dims_;
  bool traditional_;
  float scale_;
};

}  // namespace

void qfserve::detail::rope_rows(const float* x, const float* inv, const int32_t* offset,
                                float* out, const Layout& L) {
  const int rows = L.B * L.T;
  // A decode step's one position is less work than waking a thread.
  const int chunks = static_cast<int64_t>(rows) * L.H * L.D >= (1 << 15) ? rows : 1;
  qfserve::pool().run(chunks, [&](int chunk) {
    thread_local std::vector<float> cs;
    const int first = chunks == 1 ? 0 : chunk, last = chunks == 1 ? rows : chunk + 1;
    for (int r = first; r < last; ++r) rotate(x, inv, offset, out, L, r / L.T, r % L.T, cs);
  });
}

namespace qfserve {

mx::array rope(const mx::array& x, const mx::array& inv_freqs, const mx::array& offset, int dims,
               bool traditional, float scale, mx::StreamOrDevice s) {
  if (x.ndim() != 4) throw std::invalid_argument("x must be 4-D (batch, heads, rows, dims)");
  if (x.dtype() != mx::float32 || inv_freqs.dtype() != mx::float32)
    throw std::invalid_argument("x and inv_freqs must be float32");
  if (dims < 2 || dims % 2 != 0 || dims > x.shape(3))
    throw std::invalid_argument("dims must be even, >= 2 and at most x's last dimension");
  if (inv_freqs.ndim() != 1 || inv_freqs.shape(0) != dims / 2)
    throw std::invalid_argument("inv_freqs must have dims / 2 elements");
  if (offset.dtype() != mx::int32 || offset.ndim() > 1 ||
      (offset.size() != 1 && offset.size() != static_cast<size_t>(x.shape(0))))
    throw std::invalid_argument("offset must be int32, one or one per sequence");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<Rope>(stream, dims, traditional, scale),
                   {x, inv_freqs, offset});  // all read through their strides
}

}  // namespace qfserve
