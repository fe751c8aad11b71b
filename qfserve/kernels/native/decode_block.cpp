// A decode step's attention projections and its MLP, each as one op.
//
// Why: on MLX's CPU backend every op costs ~5-7 us of dispatch whatever its size, and a decode
// step of a small model is mostly small ops: SmolLM2-135M's makes ~800 (30 layers of three
// projections, six reshapes and transposes and two rotations before attention, three
// projections and an activation after), so dispatch alone was several milliseconds of a
// ~16 ms step. These ops run the same inner routines as the single ops (detail.h), in the same
// order on the same inputs, so their results are the same bit for bit, in one dispatch:
//
//   decode_qkv: x (B, 1, K) -> q (B, Hq, 1, D), k (B, Hkv, 1, D) rotated at their positions,
//               v (B, Hkv, 1, D): the three products on the weights' codes, then RoPE.
//   decode_mlp: x (B, 1, K) -> down(swiglu(gate(x), up(x))) (B, 1, K).
//
// Weights are group-32 codes as quantized_matmul takes them (4 or 8 bits, float32 scales and
// biases); each projection passes (w, scales, biases) and its bits.

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

void start(mx::Stream stream, const std::vector<mx::array>& in, std::vector<mx::array>& out) {
  for (auto& o : out) o.set_data(mx::allocator::malloc(o.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto& a : in) encoder.set_input_array(a);
  for (auto& o : out) encoder.set_output_array(o);
}

class DecodeQKV : public mx::Primitive {
 public:
  DecodeQKV(mx::Stream stream, std::vector<int> bits, int n_heads, int n_kv_heads, int dims,
            bool traditional, float scale)
      : mx::Primitive(stream), bits_(std::move(bits)), heads_(n_heads), kv_heads_(n_kv_heads),
        dims_(dims), traditional_(traditional), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& out) override {
    // in: x, (w, scales, biases) of q, k, v, inv_freqs, offset
    start(stream(), in, out);
    const mx::array& x = in[0];
    const int K = static_cast<int>(x.shape(-1));
    const int B = static_cast<int>(x.shape(0));
    const int D = static_cast<int>(out[0].shape(3));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.dispatch([in, out, rows = qfserve::row_starts(x), K, B, D, bits = bits_,
                      heads = heads_, kv_heads = kv_heads_, dims = dims_,
                      traditional = traditional_, scale = scale_]() mutable {
      const float* x_ptr = in[0].data<float>();
      const int64_t col = in[0].strides().back();
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
           dims_ == o.dims_ && traditional_ == o.traditional_ && scale_ == o.scale_;
  }

 private:
  std::vector<int> bits_;
  int heads_, kv_heads_, dims_;
  bool traditional_;
  float scale_;
};

class DecodeMLP : public mx::UnaryPrimitive {
 public:
  DecodeMLP(mx::Stream stream, std::vector<int> bits)
      : mx::UnaryPrimitive(stream), bits_(std::move(bits)) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    // in: x, (w, scales, biases) of gate, up, down
    std::vector<mx::array> outs = {out};
    start(stream(), in, outs);
    const mx::array& x = in[0];
    const int K = static_cast<int>(x.shape(-1));
    const int M = static_cast<int>(x.size() / K);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.dispatch([in, y = out.data<float>(), rows = qfserve::row_starts(x), K, M,
                      bits = bits_]() {
      const Proj gate = proj(in, 1, bits[0]), up = proj(in, 4, bits[1]),
                 down = proj(in, 7, bits[2]);
      const int F = gate.N;
      std::vector<float> g(static_cast<size_t>(M) * F), u(g.size()), h(g.size());
      const int64_t col = in[0].strides().back();
      const float* x_ptr = in[0].data<float>();
      quantized_rows(gate.w, gate.s, gate.b, gate.bits, x_ptr, rows, col, g.data(), M, F, K);
      quantized_rows(up.w, up.s, up.b, up.bits, x_ptr, rows, col, u.data(), M, F, K);
      std::vector<int64_t> h_rows(M);
      for (int m = 0; m < M; ++m) {
        const size_t at = static_cast<size_t>(m) * F;
        qfserve::detail::swiglu_row(g.data() + at, u.data() + at, h.data() + at, F);
        h_rows[m] = static_cast<int64_t>(at);
      }
      quantized_rows(down.w, down.s, down.b, down.bits, h.data(), h_rows, 1, y, M, down.N, F);
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("qfserve's decode_mlp runs on the CPU only");
  }
  const char* name() const override { return "QfserveDecodeMLP"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    return bits_ == static_cast<const DecodeMLP&>(other).bits_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[0].shape()};
  }

 private:
  std::vector<int> bits_;
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
                                  bool traditional, float scale, mx::StreamOrDevice s) {
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
  auto stream = mx::to_stream(s, mx::Device::cpu);
  std::vector<mx::array> inputs = {x, q[0], q[1], q[2], k[0], k[1], k[2],
                                   v[0], v[1], v[2], inv_freqs, offset};
  return mx::array::make_arrays(
      {{B, n_heads, 1, D}, {B, n_kv_heads, 1, D}, {B, n_kv_heads, 1, D}},
      {mx::float32, mx::float32, mx::float32},
      std::make_shared<DecodeQKV>(stream, std::vector<int>{qb, kb, vb}, n_heads, n_kv_heads,
                                  dims, traditional, scale),
      inputs);
}

mx::array decode_mlp(const mx::array& x, const std::vector<mx::array>& gate,
                     const std::vector<mx::array>& up, const std::vector<mx::array>& down,
                     mx::StreamOrDevice s) {
  check_x(x);
  const int K = static_cast<int>(x.shape(2));
  const auto [gb, gn] = codes(gate, K, "gate");
  const auto [ub, un] = codes(up, K, "up");
  const auto [db, dn] = codes(down, gn, "down");
  if (gn != un || dn != K)
    throw std::invalid_argument("gate and up must have the same rows, down the input's width");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  return mx::array(x.shape(), mx::float32,
                   std::make_shared<DecodeMLP>(stream, std::vector<int>{gb, ub, db}),
                   {x, gate[0], gate[1], gate[2], up[0], up[1], up[2], down[0], down[1], down[2]});
}

}  // namespace qfserve
