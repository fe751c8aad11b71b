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
//                weights' codes -> each head of q and k RMS-normalised (where given: Gemma 3,
//                Qwen3) -> q (B, Hq, 1, D) and k (B, Hkv, 1, D) rotated at their positions,
//                v (B, Hkv, 1, D).
//   decode_tail: attention's output a (B, Hq, 1, D) and the block's input x (B, 1, K) ->
//                h = x + post(o(a)); h + post'(down(act(gate(n), up(n)))) with n = RMS norm
//                of h, act SwiGLU (Llama) or gelu_approx(gate) * up (Gemma), and post,
//                post' RMS norms where given (Gemma's post-attention and post-feed-forward
//                norms), else nothing.
// The gelu_approx is the native gelu_glu op's routine, which Gemma's MLP also takes outside
// these ops (MLX's own nn.gelu_approx is a compiled graph: equal to float32 rounding).
//
// Weights are codes as quantized_matmul takes them (MLX's affine layout, 4, 5, 6 or 8 bits,
// float32 or float16 scales and biases); each projection passes (w, scales, biases).

#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "detail.h"
#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "rows.h"

namespace mx = mlx::core;
using qfserve::detail::Codes;
using qfserve::detail::quantized_rows;

namespace {

// One projection's codes: inputs [first, first + 3) of an op, in the layout checked at build.
Codes proj(const std::vector<mx::array>& in, size_t first, const Codes& layout) {
  return qfserve::detail::bind(layout, in[first], in[first + 1], in[first + 2]);
}

bool same(const std::vector<Codes>& a, const std::vector<Codes>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i)
    if (a[i].bits != b[i].bits || a[i].group != b[i].group || a[i].N != b[i].N ||
        a[i].K != b[i].K || a[i].half != b[i].half)
      return false;
  return true;
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
  DecodeQKV(mx::Stream stream, std::vector<Codes> layouts, int n_heads, int n_kv_heads,
            int dims, bool traditional, float scale, bool norm, bool head_norms, float eps)
      : mx::Primitive(stream), layouts_(std::move(layouts)), heads_(n_heads), kv_heads_(n_kv_heads),
        dims_(dims), traditional_(traditional), scale_(scale), norm_(norm),
        head_norms_(head_norms), eps_(eps) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& out) override {
    // in: x, (w, scales, biases) of q, k, v, inv_freqs, offset[, norm weight][, q's and k's
    // head norm weights]
    start(stream(), in, out);
    const mx::array& x = in[0];
    const int K = static_cast<int>(x.shape(-1));
    const int B = static_cast<int>(x.shape(0));
    const int D = static_cast<int>(out[0].shape(3));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.dispatch([in, out, rows = qfserve::row_starts(x), K, B, D, layouts = layouts_,
                      heads = heads_, kv_heads = kv_heads_, dims = dims_,
                      traditional = traditional_, scale = scale_, norm = norm_,
                      head_norms = head_norms_, eps = eps_]() mutable {
      const float* x_ptr = in[0].data<float>();
      int64_t col = in[0].strides().back();
      // Scratch kept by the stream's thread between calls (two ops a layer and step).
      thread_local std::vector<float> normed, tmp, raw;
      if (norm) {  // as the rms_norm op: each row, then the products read the normed rows
        normed.resize(static_cast<size_t>(B) * K);
        const std::vector<float> weight = elements(in[12]);
        tmp.resize(K);
        for (int b = 0; b < B; ++b) {
          for (int i = 0; i < K; ++i) tmp[i] = x_ptr[rows[b] + i * col];
          qfserve::detail::rms_row(tmp.data(), weight.data(), normed.data() + b * K, K, eps);
          rows[b] = static_cast<int64_t>(b) * K;
        }
        x_ptr = normed.data();
        col = 1;
      }
      const mx::array &inv = in[10], &offset = in[11];
      raw.resize(static_cast<size_t>(B) * heads * D);
      for (int p = 0; p < 3; ++p) {
        const Codes w = proj(in, 1 + 3 * p, layouts[p]);
        const int H = p == 0 ? heads : kv_heads;
        // v is stored as produced; q and k are rotated from a scratch copy, as RoPE reads
        // the product (B, 1, H * D) viewed as (B, H, 1, D).
        float* y = p == 2 ? out[2].data<float>() : raw.data();
        quantized_rows(w, x_ptr, rows, col, y, B);
        if (p == 2) continue;
        if (head_norms) {  // as the norm op on (B, H, 1, D): each head's D elements, in place
          const std::vector<float> weight = elements(in[12 + (norm ? 1 : 0) + p]);
          for (int bh = 0; bh < B * H; ++bh) {
            float* head = raw.data() + static_cast<size_t>(bh) * D;
            qfserve::detail::rms_row(head, weight.data(), head, D, eps);
          }
        }
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
    return same(layouts_, o.layouts_) && heads_ == o.heads_ && kv_heads_ == o.kv_heads_ &&
           dims_ == o.dims_ && traditional_ == o.traditional_ && scale_ == o.scale_ &&
           norm_ == o.norm_ && head_norms_ == o.head_norms_ && eps_ == o.eps_;
  }

 private:
  std::vector<Codes> layouts_;
  int heads_, kv_heads_, dims_;
  bool traditional_;
  float scale_;
  bool norm_, head_norms_;
  float eps_;
};

// x (n floats) RMS-normalised in place by weight (n,) where given (a post norm), else kept.
void post_norm(float* x, const std::vector<float>& weight, int n, float eps) {
  if (!weight.empty()) qfserve::detail::rms_row(x, weight.data(), x, n, eps);
}

class DecodeTail : public mx::UnaryPrimitive {
 public:
  DecodeTail(mx::Stream stream, std::vector<Codes> layouts, float eps, bool post_attention,
             bool post_feedforward, bool gelu)
      : mx::UnaryPrimitive(stream), layouts_(std::move(layouts)), eps_(eps),
        post_attention_(post_attention), post_feedforward_(post_feedforward), gelu_(gelu) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    // in: a, x, (w, scales, biases) of o, the norm's weight, (w, scales, biases) of gate,
    // up, down[, the post-attention norm's weight][, the post-feed-forward norm's weight]
    std::vector<mx::array> outs = {out};
    start(stream(), in, outs);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.dispatch([in, y = out.data<float>(), x_rows = qfserve::row_starts(in[1]),
                      layouts = layouts_, eps = eps_, post_attention = post_attention_,
                      post_feedforward = post_feedforward_, gelu = gelu_]() {
      const int M = static_cast<int>(x_rows.size()), K = static_cast<int>(in[1].shape(-1));
      const Codes o = proj(in, 2, layouts[0]), gate = proj(in, 6, layouts[1]),
                  up = proj(in, 9, layouts[2]), down = proj(in, 12, layouts[3]);
      const int F = gate.N, A = static_cast<int>(in[0].size() / M);
      const std::vector<float> after_o = post_attention ? elements(in[15]) : std::vector<float>{},
                               after_mlp = post_feedforward ? elements(in[15 + post_attention])
                                                            : std::vector<float>{};
      // a (B, Hq, 1, D) as rows of Hq * D, the layout its reshape for o has.
      // Scratch kept by the stream's thread between calls (two ops a layer and step).
      thread_local std::vector<float> a, h, n, g, u, act;
      a.resize(in[0].size());
      const mx::array& at = in[0];
      const float* a_ptr = at.data<float>();
      const int Hq = static_cast<int>(at.shape(1)), D = static_cast<int>(at.shape(3));
      for (int m = 0; m < M; ++m)
        for (int hd = 0; hd < Hq * D; ++hd)
          a[static_cast<size_t>(m) * A + hd] =
              a_ptr[m * at.strides()[0] + (hd / D) * at.strides()[1] + (hd % D) * at.strides()[3]];
      std::vector<int64_t> a_rows(M);
      for (int m = 0; m < M; ++m) a_rows[m] = static_cast<int64_t>(m) * A;
      // h = x + post(o(a)): the product, its norm, then the residual add, as the ops compute.
      h.resize(static_cast<size_t>(M) * K);
      n.resize(h.size());
      quantized_rows(o, a.data(), a_rows, 1, h.data(), M);
      const float* x = in[1].data<float>();
      const int64_t xs = in[1].strides().back();
      const std::vector<float> weight = elements(in[5]);
      std::vector<int64_t> h_rows(M), f_rows(M);
      for (int m = 0; m < M; ++m) {
        float* hm = h.data() + static_cast<size_t>(m) * K;
        post_norm(hm, after_o, K, eps);
        for (int i = 0; i < K; ++i) hm[i] = x[x_rows[m] + i * xs] + hm[i];
        qfserve::detail::rms_row(hm, weight.data(), n.data() + static_cast<size_t>(m) * K, K, eps);
        h_rows[m] = static_cast<int64_t>(m) * K;
        f_rows[m] = static_cast<int64_t>(m) * F;
      }
      // The MLP on n, then h + post'(its output).
      g.resize(static_cast<size_t>(M) * F);
      u.resize(g.size());
      act.resize(g.size());
      quantized_rows(gate, n.data(), h_rows, 1, g.data(), M);
      quantized_rows(up, n.data(), h_rows, 1, u.data(), M);
      for (int m = 0; m < M; ++m) {
        const size_t at = static_cast<size_t>(m) * F;
        if (gelu)
          qfserve::detail::gelu_glu_row(g.data() + at, u.data() + at, act.data() + at, F);
        else
          qfserve::detail::swiglu_row(g.data() + at, u.data() + at, act.data() + at, F);
      }
      quantized_rows(down, act.data(), f_rows, 1, y, M);
      for (int m = 0; m < M; ++m) post_norm(y + static_cast<size_t>(m) * K, after_mlp, K, eps);
      for (size_t i = 0; i < h.size(); ++i) y[i] = h[i] + y[i];
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("qfserve's decode_tail runs on the CPU only");
  }
  const char* name() const override { return "QfserveDecodeTail"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const DecodeTail&>(other);
    return same(layouts_, o.layouts_) && eps_ == o.eps_ &&
           post_attention_ == o.post_attention_ && post_feedforward_ == o.post_feedforward_ &&
           gelu_ == o.gelu_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {inputs[1].shape()};
  }

 private:
  std::vector<Codes> layouts_;
  float eps_;
  bool post_attention_, post_feedforward_, gelu_;
};

// Checks one projection's codes against the input width K; returns their layout.
Codes codes(const std::vector<mx::array>& p, int K, const char* what) {
  if (p.size() != 3) throw std::invalid_argument(std::string(what) + ": (w, scales, biases)");
  try {
    const Codes c = qfserve::detail::codes_of(p[0], p[1], p[2], K);
    if (!p[0].flags().row_contiguous || !p[1].flags().row_contiguous ||
        !p[2].flags().row_contiguous)
      throw std::invalid_argument("codes must be row-contiguous");
    return c;
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string(what) + ": " + e.what());
  }
}

bool vector_of(const mx::array& w, int n) {
  return w.ndim() == 1 && w.shape(0) == n && w.dtype() == mx::float32;
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
                                  const std::vector<mx::array>& head_norms,
                                  mx::StreamOrDevice s) {
  check_x(x);
  const int K = static_cast<int>(x.shape(2)), B = static_cast<int>(x.shape(0));
  const Codes qc = codes(q, K, "q"), kc = codes(k, K, "k"), vc = codes(v, K, "v");
  const int qn = qc.N, kn = kc.N, vn = vc.N;
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
  if (norm && !vector_of(*norm, K))
    throw std::invalid_argument("norm must be float32 (K,)");
  if (!head_norms.empty() &&
      (head_norms.size() != 2 || !vector_of(head_norms[0], D) || !vector_of(head_norms[1], D)))
    throw std::invalid_argument("head_norms must be q's and k's, each float32 (D,)");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  std::vector<mx::array> inputs = {x, q[0], q[1], q[2], k[0], k[1], k[2],
                                   v[0], v[1], v[2], inv_freqs, offset};
  if (norm) inputs.push_back(*norm);
  inputs.insert(inputs.end(), head_norms.begin(), head_norms.end());
  return mx::array::make_arrays(
      {{B, n_heads, 1, D}, {B, n_kv_heads, 1, D}, {B, n_kv_heads, 1, D}},
      {mx::float32, mx::float32, mx::float32},
      std::make_shared<DecodeQKV>(stream, std::vector<Codes>{qc, kc, vc}, n_heads, n_kv_heads,
                                  dims, traditional, scale, norm.has_value(), !head_norms.empty(),
                                  eps),
      inputs);
}

mx::array decode_tail(const mx::array& a, const mx::array& x, const std::vector<mx::array>& o,
                      const mx::array& norm, float eps, const std::vector<mx::array>& gate,
                      const std::vector<mx::array>& up, const std::vector<mx::array>& down,
                      const std::optional<mx::array>& post_attention,
                      const std::optional<mx::array>& post_feedforward,
                      const std::string& activation, mx::StreamOrDevice s) {
  check_x(x);
  const int K = static_cast<int>(x.shape(2));
  if (a.ndim() != 4 || a.shape(0) != x.shape(0) || a.shape(2) != 1 || a.dtype() != mx::float32)
    throw std::invalid_argument("a must be float32 (B, heads, 1, D), one row per sequence");
  const int A = static_cast<int>(a.shape(1) * a.shape(3));
  const Codes oc = codes(o, A, "o"), gc = codes(gate, K, "gate"), uc = codes(up, K, "up");
  const Codes dc = codes(down, gc.N, "down");
  const int on = oc.N, gn = gc.N, un = uc.N, dn = dc.N;
  if (on != K || gn != un || dn != K)
    throw std::invalid_argument("o and down must give the input's width, gate and up the same");
  if (!vector_of(norm, K) || (post_attention && !vector_of(*post_attention, K)) ||
      (post_feedforward && !vector_of(*post_feedforward, K)))
    throw std::invalid_argument("norms must be float32 (K,)");
  if (activation != "swiglu" && activation != "gelu_approx")
    throw std::invalid_argument("activation must be swiglu or gelu_approx");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  std::vector<mx::array> inputs = {a,       x,       o[0],    o[1],  o[2],  norm,
                                   gate[0], gate[1], gate[2], up[0], up[1], up[2],
                                   down[0], down[1], down[2]};
  if (post_attention) inputs.push_back(*post_attention);
  if (post_feedforward) inputs.push_back(*post_feedforward);
  return mx::array(
      x.shape(), mx::float32,
      std::make_shared<DecodeTail>(stream, std::vector<Codes>{oc, gc, uc, dc}, eps,
                                   post_attention.has_value(), post_feedforward.has_value(),
                                   activation == "gelu_approx"),
      inputs);
}

}  // namespace qfserve
