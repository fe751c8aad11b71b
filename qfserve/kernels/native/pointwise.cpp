// RMS normalisation and SwiGLU, the row-wise and element-wise ops of a transformer block, on
// the CPU, one op each.
//
// Why by hand: on MLX's CPU backend mx.fast.rms_norm runs a fallback of several ops (~50 us
// for one row of 576, 1 ms for 512 rows) and mlx-lm's compiled swiglu evaluates silu with a
// scalar exp (~42 us for one row of 1,536, 19 ms for 512 rows: 0.57 s of a 512-token chunk of
// SmolLM2-135M's 30 layers). Here each is one pass over the rows with 16-float vectors (a
// vector exp, simd.h), split over the kernels' pool when there are many rows.
//
//   rms_norm(x, w)[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * w
//   swiglu(g, u)      = g * sigmoid(g) * u = g / (1 + exp(-g)) * u
//   gelu_glu(g, u)    = gelu_approx(g) * u (Gemma's MLP; MLX's compiled gelu_approx takes a
//                       scalar tanh per element)
//   log_softmax(x)[r] = x[r] - logsumexp(x[r]), and the first index of its largest entry: a
//                       decode step's log-probabilities and greedy draw over the vocabulary
//                       (MLX's CPU logsumexp and argmax are scalar on x86: 0.78 and 0.14 ms
//                       for one row of 49,152, 4.1 and 0.39 ms for 262,144)

#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "detail.h"
#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "pool.h"
#include "rows.h"
#include "simd.h"

namespace mx = mlx::core;
using qfserve::row_starts;
using namespace qfserve::simd;

namespace {

// Rows in chunks over the pool when the work is large enough to be worth a thread.
template <typename F>
void over_rows(int64_t rows, int64_t per_row, const F& f) {
  const int64_t per_chunk = std::max<int64_t>(1, (1 << 14) / std::max<int64_t>(1, per_row));
  const int chunks = static_cast<int>((rows + per_chunk - 1) / per_chunk);
  qfserve::pool().run(chunks, [&](int c) {
    const int64_t first = c * per_chunk, last = std::min(rows, first + per_chunk);
    for (int64_t r = first; r < last; ++r) f(r);
  });
}

// A row as a contiguous float pointer: itself, or gathered into `tmp` when strided.
inline const float* row(const float* base, int64_t start, int64_t stride, int n,
                        std::vector<float>& tmp) {
  if (stride == 1) return base + start;
  tmp.resize(n);
  for (int i = 0; i < n; ++i) tmp[i] = base[start + i * stride];
  return tmp.data();
}

class RmsNorm : public mx::UnaryPrimitive {
 public:
  RmsNorm(mx::Stream stream, float eps) : mx::UnaryPrimitive(stream), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& x = inputs[0];
    const mx::array& w = inputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_input_array(w);
    encoder.set_output_array(out);
    encoder.dispatch([x_ptr = x.data<float>(), w_ptr = w.data<float>(), o_ptr = out.data<float>(),
                      starts = row_starts(x), x_s = x.strides().back(), w_s = w.strides()[0],
                      n = static_cast<int>(x.shape(-1)), eps = eps_]() {
      std::vector<float> weight(n);
      for (int i = 0; i < n; ++i) weight[i] = w_ptr[i * w_s];
      over_rows(static_cast<int64_t>(starts.size()), n, [&](int64_t r) {
        thread_local std::vector<float> tmp;
        qfserve::detail::rms_row(row(x_ptr, starts[r], x_s, n, tmp), weight.data(),
                                 o_ptr + r * n, n, eps);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("qfserve's rms_norm runs on the CPU only");
  }
  const char* name() const override { return "QfserveRmsNorm"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return eps_ == static_cast<const RmsNorm&>(other).eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  float eps_;
};

// swiglu(g, u), or gelu_approx(g) * u where `gelu` (Gemma's MLP).
class Gated : public mx::UnaryPrimitive {
 public:
  Gated(mx::Stream stream, bool gelu) : mx::UnaryPrimitive(stream), gelu_(gelu) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& g = inputs[0];
    const mx::array& u = inputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(g);
    encoder.set_input_array(u);
    encoder.set_output_array(out);
    encoder.dispatch([g_ptr = g.data<float>(), u_ptr = u.data<float>(), o_ptr = out.data<float>(),
                      g_rows = row_starts(g), u_rows = row_starts(u), g_s = g.strides().back(),
                      u_s = u.strides().back(), n = static_cast<int>(g.shape(-1)),
                      gelu = gelu_]() {
      over_rows(static_cast<int64_t>(g_rows.size()), n, [&](int64_t r) {
        thread_local std::vector<float> tg, tu;
        const float* gr = row(g_ptr, g_rows[r], g_s, n, tg);
        const float* ur = row(u_ptr, u_rows[r], u_s, n, tu);
        if (gelu)
          qfserve::detail::gelu_glu_row(gr, ur, o_ptr + r * n, n);
        else
          qfserve::detail::swiglu_row(gr, ur, o_ptr + r * n, n);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("qfserve's gated activations run on the CPU only");
  }
  const char* name() const override { return gelu_ ? "QfserveGeluGlu" : "QfserveSwiGlu"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return gelu_ == static_cast<const Gated&>(other).gelu_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  bool gelu_;
};

// x - logsumexp(x) per row, and the first index of each result row's largest entry, as MLX
// computes x - mx.logsumexp(x) and mx.argmax of it: logsumexp is the row's max where that is
// infinite, NaN where the row holds a NaN; argmax takes the first NaN over any number.
class LogSoftmax : public mx::Primitive {
 public:
  explicit LogSoftmax(mx::Stream stream) : mx::Primitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array& x = inputs[0];
    mx::array& out = outputs[0];
    mx::array& best = outputs[1];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    best.set_data(mx::allocator::malloc(best.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(x);
    encoder.set_output_array(out);
    encoder.set_output_array(best);
    encoder.dispatch([x_ptr = x.data<float>(), o_ptr = out.data<float>(),
                      b_ptr = best.data<uint32_t>(), starts = row_starts(x),
                      x_s = x.strides().back(), n = static_cast<int>(x.shape(-1))]() {
      over_rows(static_cast<int64_t>(starts.size()), n, [&](int64_t r) {
        thread_local std::vector<float> tmp;
        b_ptr[r] = log_softmax_row(row(x_ptr, starts[r], x_s, n, tmp), o_ptr + r * n, n);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("qfserve's log_softmax runs on the CPU only");
  }
  const char* name() const override { return "QfserveLogSoftmax"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const mx::Shape& shape = inputs[0].shape();
    return {shape, mx::Shape(shape.begin(), shape.end() - 1)};
  }

 private:
  // One row: its max (NaN noted), the sum of exp(x - max), then x - lse written while the
  // first largest entry is found, lane by lane and then across lanes.
  static uint32_t log_softmax_row(const float* x, float* o, int n) {
    constexpr float inf = std::numeric_limits<float>::infinity();
    vf top = splat(-inf);
    vi nan{};
    int i = 0;
    for (; i + W <= n; i += W) {
      const vf v = load(x + i);
      nan |= v != v;
      top = vmax(top, v);
    }
    float m = hmax(top);
    bool any_nan = false;
    for (int l = 0; l < W; ++l) any_nan |= nan[l] != 0;
    for (; i < n; ++i) any_nan |= std::isnan(x[i]), m = std::max(m, x[i]);
    float lse = any_nan ? std::numeric_limits<float>::quiet_NaN() : m;
    if (!any_nan && std::isfinite(m)) {
      vf acc{};
      for (i = 0; i + W <= n; i += W) acc += vexp(load(x + i) - m);
      float sum = hsum(acc);
      for (; i < n; ++i) sum += std::exp(x[i] - m);
      lse = m + std::log(sum);
    }
    if (!std::isfinite(lse)) {  // every result NaN but the -inf ones: the first NaN is first
      int64_t first_nan = -1;
      for (i = 0; i < n; ++i) {
        o[i] = x[i] - lse;
        if (first_nan < 0 && std::isnan(o[i])) first_nan = i;
      }
      return static_cast<uint32_t>(std::max<int64_t>(first_nan, 0));
    }
    // Lane l sees entries l, l + W, ...: a strictly larger one takes over, so each lane keeps
    // its first largest; across lanes the largest wins, the lower index on a tie.
    vf lane_best = splat(-inf);
    vi lane_at{}, at{};
    for (int l = 0; l < W; ++l) at[l] = l;
    for (i = 0; i + W <= n; i += W, at += W) {
      const vf v = load(x + i) - lse;
      store(o + i, v);
      const vi wins = v > lane_best;
      lane_best = wins ? v : lane_best;
      lane_at = wins ? at : lane_at;
    }
    float best = -inf;
    int64_t best_at = 0;
    auto consider = [&](float v, int64_t k) {
      if (v > best || (v == best && k < best_at)) best = v, best_at = k;
    };
    for (int l = 0; l < W && l < n; ++l) consider(lane_best[l], lane_at[l]);
    for (; i < n; ++i) consider(o[i] = x[i] - lse, i);
    return static_cast<uint32_t>(best_at);
  }
};

mx::array gated(const mx::array& gate, const mx::array& up, bool gelu, mx::StreamOrDevice s) {
  if (gate.shape() != up.shape() || gate.ndim() < 1)
    throw std::invalid_argument("gate and up must have the same shape");
  if (gate.dtype() != mx::float32 || up.dtype() != mx::float32)
    throw std::invalid_argument("gate and up must be float32");
  return mx::array(gate.shape(), mx::float32,
                   std::make_shared<Gated>(mx::to_stream(s, mx::Device::cpu), gelu), {gate, up});
}

}  // namespace

void qfserve::detail::rms_row(const float* x, const float* weight, float* o, int n, float eps) {
  int i = 0;
  vf acc{};
  for (; i + W <= n; i += W) {
    const vf v = load(x + i);
    acc += v * v;
  }
  float sum = hsum(acc);
  for (; i < n; ++i) sum += x[i] * x[i];
  const float inv = 1.0f / std::sqrt(sum / n + eps);
  for (i = 0; i + W <= n; i += W) store(o + i, load(x + i) * inv * load(weight + i));
  for (; i < n; ++i) o[i] = x[i] * inv * weight[i];
}

void qfserve::detail::swiglu_row(const float* g, const float* u, float* o, int n) {
  int i = 0;
  for (; i + W <= n; i += W) {
    const vf x = load(g + i);
    store(o + i, x / (1.0f + vexp(-x)) * load(u + i));
  }
  for (; i < n; ++i) o[i] = g[i] / (1.0f + std::exp(-g[i])) * u[i];
}

void qfserve::detail::gelu_glu_row(const float* g, const float* u, float* o, int n) {
  // 0.5 x (1 + tanh(t)) = x * sigmoid(2t) = x / (1 + exp(-2t)): the same function without
  // 1 + tanh's cancellation where t is negative, exact at both ends (exp's 0 and its clamp).
  constexpr float c = 0.7978845608028654f;  // sqrt(2 / pi)
  int i = 0;
  for (; i + W <= n; i += W) {
    const vf x = load(g + i);
    const vf t = c * (x + 0.044715f * (x * x * x));
    store(o + i, x / (1.0f + vexp(-2.0f * t)) * load(u + i));
  }
  for (; i < n; ++i) {
    const float x = g[i];
    const float t = c * (x + 0.044715f * (x * x * x));
    o[i] = x / (1.0f + std::exp(-2.0f * t)) * u[i];
  }
}

namespace qfserve {

mx::array rms_norm(const mx::array& x, const mx::array& weight, float eps, mx::StreamOrDevice s) {
  if (x.ndim() < 1 || x.dtype() != mx::float32 || weight.dtype() != mx::float32)
    throw std::invalid_argument("x and weight must be float32, x at least 1-D");
  if (weight.ndim() != 1 || weight.shape(0) != x.shape(-1))
    throw std::invalid_argument("weight must be 1-D with x's last dimension");
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<RmsNorm>(mx::to_stream(s, mx::Device::cpu), eps),
                   {x, weight});
}

mx::array swiglu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  return gated(gate, up, false, s);
}

mx::array gelu_glu(const mx::array& gate, const mx::array& up, mx::StreamOrDevice s) {
  return gated(gate, up, true, s);
}

std::vector<mx::array> log_softmax(const mx::array& x, mx::StreamOrDevice s) {
  if (x.ndim() < 1 || x.dtype() != mx::float32 || x.shape(-1) < 1)
    throw std::invalid_argument("x must be float32, at least 1-D, with a non-empty last axis");
  const mx::Shape rows(x.shape().begin(), x.shape().end() - 1);
  return mx::array::make_arrays({x.shape(), rows}, {mx::float32, mx::uint32},
                                std::make_shared<LogSoftmax>(mx::to_stream(s, mx::Device::cpu)),
                                {x});
}

}  // namespace qfserve
