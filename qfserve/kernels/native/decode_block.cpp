// A decode step's transformer block as two ops around its cache and attention.
//
// Why: on MLX's CPU backend every op costs microseconds of dispatch whatever its size, and a
// decode step of a small model is mostly small ops: SmolLM2-135M's made ~800 (per layer two
// norms, three projections, six reshapes and transposes and two rotations before attention,
// one projection, two residual adds, three projections and an activation after), and the
// Python that builds them runs beside the step's arithmetic on the same cores. These ops run
// the single ops' own routines (detail.h), in the same order on the same inputs, so their
// results are the same bit for bit, in one dispatch each:
//
//   decode_qkv:  x (B, 1, K) -> RMS norm (where given) -> the q, k, v products on the
//                weights' codes -> q (B, Hq, 1, D) and k (B, Hkv, 1, D) rotated at their
//                positions, v (B, Hkv, 1, D).
//   decode_tail: attention's output a (B, Hq, 1, D) and the block's input x (B, 1, K) ->
//                h = x + o(a); h + down(swiglu(gate(n), up(n))) with n = RMS norm of h.
//
// Weights are group-32 codes as quantized_matmul takes them (4 or 8 bits, float32 scales and
// biases); each projection passes (w, scales, biases) and its bits.

#include <optional>
#include <stdexcept>
#include <vector>

#include "detail.h"
#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "rows.h"

namespace mx = mlx::core;
using qfserve::detail::quantized_rows;

namespace {

// One projection's codes: inputs [first, first + 3) of an op.
struct Proj {
  const uint8_t* w;
  const float* s;
  const float* b;
  int bits, N;
};

Proj proj(const std::vector<mx::array>& in, size_t first, int bits) {
  return {in[first].data<uint8_t>(), in[first + 1].data<float>(), in[first + 2].data<float>(),
          bits, static_cast<int>(in[first].shape(0))};
}

// A 1-D array's elements, contiguous (a norm's weight, read through its stride).
std::vector<float> elements(const mx::array& a) {
  std::vector<float> out(a.size());
  const float* p = a.data<float>();
  for (size_t i = 0; i < out.size(); ++i) out[i] = p[i * a.strides()[0]];
  return out;
}

void start(mx::Stream stream, const std::vector<mx::array>& in, std::vector<mx::array>& out) {
  for (auto& o : out) o.set_data(mx::allocator::malloc(o.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& a : in) encoder.set_input_array(a);
  for (auto& o : out) encoder.set_output_array(o);
}

class DecodeQKV : public mx::Primitive {
 public:
  DecodeQKV(mx::Stream stream, std::vector<int> bits, int n_heads, int n_kv_heads, int dims,
            bool traditional, float scale, bool norm, float eps)
      : mx::Primitive(stream), bits_(std::move(bits)), heads_(n_heads), kv_heads_(n_kv_heads),
        dims_(dims), traditional_(traditional), scale_(scale), norm_(norm), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& out) override {
    // in: x, (w, scales, biases) of q, k, v, inv_freqs, offset[, norm weight]
    start(stream(), in, out);
    const mx::array& x = in[0];
    const int K = static_cast<int>(x.shape(-1));
    const int B = static_cast<int>(x.shape(0));
    const int D = static_cast<int>(out[0].shape(3));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.dispatch([in, out, rows = qfserve::row_starts(x), K, B, D, bits = bits_,
                      heads = heads_, kv_heads = kv_heads_, dims = dims_,
                      traditional = traditional_, scale = scale_, norm = norm_,
                      eps = eps_]() mutable {
      const float* x_ptr = in[0].data<float>();
      int64_t col = in[0].strides().back();
      std::vector<float> normed;
      if (norm) {  // as the rms_norm op: each row, then the products read the normed rows
        normed.resize(static_cast<size_t>(B) * K);
        const std::vector<float> weight = elements(in[12]);
        std::vector<float> tmp(K);
        for (int b = 0; b < B; ++b) {
          for (int i = 0; i < K; ++i) tmp[i] = x_ptr[rows[b] + i * col];
          qfserve::detail::rms_row(tmp.data(), weight.data(), normed.data() + b * K, K, eps);
          rows[b] = static_cast<int64_t>(b) * K;
        }
        x_ptr = normed.data();
        col = 1;
      }
      const mx::array &inv = in[10], &offset = in[11];
      std::vector<float> raw(static_cast<size_t>(B) * heads * D);
      for (int p = 0; p < 3; ++p) {
        const Proj w = proj(in, 1 + 3 * p, bits[p]);
        const int H = p == 0 ? heads : kv_heads;
        // v is stored as produced; q and k are rotated from a scratch copy, as RoPE reads
        // the product (B, 1, H * D) viewed as (B, H, 1, D).
        float* y = p == 2 ? out[2].data<float>() : raw.data();
        quantized_rows(w.w, w.s, w.b, w.bits, x_ptr, rows, col, y, B, w.N, K);
        if (p == 2) continue;
        const qfserve::detail::RopeLayout L{
            B, H, 1, D, dims, static_cast<int64_t>(H) * D, D, static_cast<int64_t>(H) * D, 1,
            inv.strides()[0], offset.size() > 1 ? offset.strides()[0] : 0, traditional, scale};
        qfserve::detail::rope_rows(raw.data(), inv.data<float>(), offset.data<int32_t>(),
                                   out[p].data<float>(), L);
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("qfserve's decode_qkv runs on the CPU only");
  }
  const char* name() const override { return "QfserveDecodeQKV"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DecodeQKV&>(other);
    return bits_ == o.bits_ && heads_ == o.heads_ && kv_heads_ == o.kv_heads_ &&
           dims_ == o.dims_ && traditional_ == o.traditional_ && scale_ == o.scale_ &&
           norm_ == o.norm_ && eps_ == o.eps_;
  }

 private:
  std::vector<int> bits_;
  int heads_, kv_heads_, dims_;
  bool traditional_;
  float scale_;
  bool norm_;
  float eps_;
};

class DecodeTail : public mx::UnaryPrimitive {
 public:
  DecodeTail(mx::Stream stream, std::vector<int> bits, float eps)
      : mx::UnaryPrimitive(stream), bits_(std::move(bits)), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    // in: a, x, (w, scales, biases) of o, the norm's weight, (w, scales, biases) of gate,
    // up, down
    std::vector<mx::array> outs = {out};
    start(stream(), in, outs);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.dispatch([in, y = out.data<float>(), x_rows = qfserve::row_starts(in[1]),
                      bits = bits_, eps = eps_]() {
      const int M = static_cast<int>(x_rows.size()), K = static_cast<int>(in[1].shape(-1));
      const Proj o = proj(in, 2, bits[0]), gate = proj(in, 6, bits[1]), up = proj(in, 9, bits[2]),
                 down = proj(in, 12, bits[3]);
      const int F = gate.N, A = static_cast<int>(in[0].size() / M);
      // a (B, Hq, 1, D) as rows of Hq * D, the layout its reshape for o has.
      std::vector<float> a(in[0].size());
      const mx::array& at = in[0];
      const float* a_ptr = at.data<float>();
      const int Hq = static_cast<int>(at.shape(1)), D = static_cast<int>(at.shape(3));
      for (int m = 0; m < M; ++m)
        for (int hd = 0; hd < Hq * D; ++hd)
          a[static_cast<size_t>(m) * A + hd] =
              a_ptr[m * at.strides()[0] + (hd / D) * at.strides()[1] + (hd % D) * at.strides()[3]];
      std::vector<int64_t> a_rows(M);
      for (int m = 0; m < M; ++m) a_rows[m] = static_cast<int64_t>(m) * A;
      // h = x + o(a): the product, then the residual add, as two ops compute them.
      std::vector<float> h(static_cast<size_t>(M) * K), n(h.size());
      quantized_rows(o.w, o.s, o.b, o.bits, a.data(), a_rows, 1, h.data(), M, K, A);
      const float* x = in[1].data<float>();
      const int64_t xs = in[1].strides().back();
      const std::vector<float> weight = elements(in[5]);
      std::vector<int64_t> h_rows(M), f_rows(M);
      for (int m = 0; m < M; ++m) {
        float* hm = h.data() + static_cast<size_t>(m) * K;
        for (int i = 0; i < K; ++i) hm[i] = x[x_rows[m] + i * xs] + hm[i];
        qfserve::detail::rms_row(hm, weight.data(), n.data() + static_cast<size_t>(m) * K, K, eps);
        h_rows[m] = static_cast<int64_t>(m) * K;
        f_rows[m] = static_cast<int64_t>(m) * F;
      }
      // The MLP on n, then h + its output.
      std::vector<float> g(static_cast<size_t>(M) * F), u(g.size()), act(g.size());
      quantized_rows(gate.w, gate.s, gate.b, gate.bits, n.data(), h_rows, 1, g.data(), M, F, K);
      quantized_rows(up.w, up.s, up.b, up.bits, n.data(), h_rows, 1, u.data(), M, F, K);
      for (int m = 0; m < M; ++m) {
        const size_t at = static_cast<size_t>(m) * F;
        qfserve::detail::swiglu_row(g.data() + at, u.data() + at, act.data() + at, F);
      }
      quantized_rows(down.w, down.s, down.b, down.bits, act.data(), f_rows, 1, y, M, K, F);
      for (size_t i = 0; i < h.size(); ++i) y[i] = h[i] + y[i];
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("qfserve's decode_tail runs on the CPU only");
  }
  const char* name() const override { return "QfserveDecodeTail"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DecodeTail&>(other);
    return bits_ == o.bits_ && eps_ == o.eps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[1].shape()};
  }

 private:
  std::vector<int> bits_;
  float eps_;
};

// Checks one projection's codes against the input width K; returns its bits and rows.
std::pair<int, int> codes(const std::vector<mx::array>& p, int K, const char* what) {
  if (p.size() != 3) throw std::invalid_argument(std::string(what) + ": (w, scales, biases)");
  const mx::array &w = p[0], &s = p[1], &b = p[2];
  if (w.ndim() != 2 || s.ndim() != 2 || b.shape() != s.shape() || w.dtype() != mx::uint32 ||
      s.dtype() != mx::float32 || b.dtype() != mx::float32 || s.shape(0) != w.shape(0) ||
      s.shape(1) * 32 != K)
    throw std::invalid_argument(std::string(what) +
                                ": uint32 codes and float32 scales and biases for group-32 "
                                "rows of the input's width");
  const int bits = static_cast<int>(w.shape(1) * 32 / K);
  if ((bits != 4 && bits != 8) || w.shape(1) * 32 != static_cast<int64_t>(K) * bits)
    throw std::invalid_argument(std::string(what) + ": codes of 4 or 8 bits");
  if (!w.flags().row_contiguous || !s.flags().row_contiguous || !b.flags().row_contiguous)
    throw std::invalid_argument(std::string(what) + ": codes must be row-contiguous");
  return {bits, static_cast<int>(w.shape(0))};
}

void check_x(const mx::array& x) {
  if (x.ndim() != 3 || x.shape(1) != 1 || x.dtype() != mx::float32)
    throw std::invalid_argument("x must be float32 (B, 1, K): one decode row per sequence");
}

}  // namespace

namespace qfserve {

std::vector<mx::array> decode_qkv(const mx::array& x, const std::vector<mx::array>& q,
                                  const std::vector<mx::array>& k,
                                  const std::vector<mx::array>& v, const mx::array& inv_freqs,
                                  const mx::array& offset, int n_heads, int n_kv_heads, int dims,
                                  bool traditional, float scale,
                                  const std::optional<mx::array>& norm, float eps,
                                  mx::StreamOrDevice s) {
  check_x(x);
  const int K = static_cast<int>(x.shape(2)), B = static_cast<int>(x.shape(0));
  const auto [qb, qn] = codes(q, K, "q");
  const auto [kb, kn] = codes(k, K, "k");
  const auto [vb, vn] = codes(v, K, "v");
  if (n_heads < 1 || n_kv_heads < 1 || qn % n_heads != 0 || qn / n_heads != kn / n_kv_heads ||
      kn != vn || kn % n_kv_heads != 0)
    throw std::invalid_argument("q, k and v rows must be heads x one head dimension");
  const int D = qn / n_heads;
  if (dims < 2 || dims % 2 != 0 || dims > D || inv_freqs.dtype() != mx::float32 ||
      inv_freqs.ndim() != 1 || inv_freqs.shape(0) != dims / 2)
    throw std::invalid_argument("dims must be even and at most the head dimension, with "
                                "dims / 2 float32 inv_freqs");
  if (offset.dtype() != mx::int32 || offset.ndim() > 1 ||
      (offset.size() != 1 && offset.size() != static_cast<size_t>(B)))
    throw std::invalid_argument("offset must be int32, one or one per sequence");
  if (norm && (norm->ndim() != 1 || norm->shape(0) != K || norm->dtype() != mx::float32))
    throw std::invalid_argument("norm must be float32 (K,)");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  std::vector<mx::array> inputs = {x, q[0], q[1], q[2], k[0], k[1], k[2],
                                   v[0], v[1], v[2], inv_freqs, offset};
  if (norm) inputs.push_back(*norm);
  return mx::array::make_arrays(
      {{B, n_heads, 1, D}, {B, n_kv_heads, 1, D}, {B, n_kv_heads, 1, D}},
      {mx::float32, mx::float32, mx::float32},
      std::make_shared<DecodeQKV>(stream, std::vector<int>{qb, kb, vb}, n_heads, n_kv_heads,
                                  dims, traditional, scale, norm.has_value(), eps),
      inputs);
}

mx::array decode_tail(const mx::array& a, const mx::array& x, const std::vector<mx::array>& o,
                      const mx::array& norm, float eps, const std::vector<mx::array>& gate,
                      const std::vector<mx::array>& up, const std::vector<mx::array>& down,
                      mx::StreamOrDevice s) {
  check_x(x);
  const int K = static_cast<int>(x.shape(2));
  if (a.ndim() != 4 || a.shape(0) != x.shape(0) || a.shape(2) != 1 || a.dtype() != mx::float32)
    throw std::invalid_argument("a must be float32 (B, heads, 1, D), one row per sequence");
  const int A = static_cast<int>(a.shape(1) * a.shape(3));
  const auto [ob, on] = codes(o, A, "o");
  const auto [gb, gn] = codes(gate, K, "gate");
  const auto [ub, un] = codes(up, K, "up");
  const auto [db, dn] = codes(down, gn, "down");
  if (on != K || gn != un || dn != K)
    throw std::invalid_argument("o and down must give the input's width, gate and up the same");
  if (norm.ndim() != 1 || norm.shape(0) != K || norm.dtype() != mx::float32)
    throw std::invalid_argument("norm must be float32 (K,)");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<DecodeTail>(stream, std::vector<int>{ob, gb, ub, db}, eps),
                   {a, x, o[0], o[1], o[2], norm, gate[0], gate[1], gate[2], up[0], up[1], up[2],
                    down[0], down[1], down[2]});
}

}  // namespace qfserve
