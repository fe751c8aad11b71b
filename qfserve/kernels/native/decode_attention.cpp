// Attention of one query per head (a decode step) over a layer's stored keys, on the CPU.
//
// Why by hand: MLX's CPU scaled_dot_product_attention falls back to whole ops, and with
// grouped KV heads it repeats keys and values to the query heads on every call; a
// SmolLM2-135M step over 4,096 rows spent ~70 ms of its ~110 ms there, ~2.3 ms a layer, for
// ~5 M multiply-adds. Here each KV head's keys are read where they lie (through their
// strides: a cache's rows are a slice of its buffer, and a copy of them would cost more than
// the attention). For heads of 64 in groups of up to 4 query heads (and 128 in groups of up
// to 2) each key is read once for the whole group with the queries in registers (heads of 256
// take their queries one at a time; other shapes a plain loop); the softmax is a single pass
// over a small buffer with a vector exp; the values' weighted sum is held in registers (heads
// of 64, 128 or 256). SmolLM2's shape (9 query heads on 3): 52 -> 24 us a layer at 512 rows,
// 517 -> 248 at 4,096, against the plain loops.
//
//   out[g] = sum_j softmax_j(scale * q[g] . k[j]) v[j]      for the G query heads of a KV head

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "pool.h"
#include "simd.h"

namespace mx = mlx::core;
using namespace qfserve::simd;

namespace {

// q . k over D elements. The float sum is a reduction, which the compiler does not vectorize
// without licence to reorder it, so it is written out.
inline float dot(const float* a, const float* b, int D) {
  int d = 0;
  float sum = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; d + 16 <= D; d += 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(b + d), acc);
  sum = _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (; d + 8 <= D; d += 8)
    acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + d), _mm256_loadu_ps(b + d), acc);
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  sum = _mm_cvtss_f32(_mm_add_ss(s4, _mm_shuffle_ps(s4, s4, 1)));
#endif
  for (; d < D; ++d) sum += a[d] * b[d];
  return sum;
}

struct Layout {  // element strides of q, k, v and the key mask, and the shapes
  int B, Hq, H, S, D, Dv;
  int64_t q_b, q_h, q_d, k_b, k_h, k_s, k_d, v_b, v_h, v_s, v_d, m_b, m_h, m_s;
};

// q . k over D elements with strides (a cache's rows are a slice of its buffer: read in
// place, since copying them would cost more than the attention).
inline float strided_dot(const float* a, int64_t sa, const float* b, int64_t sb, int D) {
  if (sa == 1 && sb == 1) return dot(a, b, D);
  float sum = 0.f;
  for (int d = 0; d < D; ++d) sum += a[d * sa] * b[d * sb];
  return sum;
}

// The weighted sum of S value rows of NV x W contiguous floats into og (a softmax's
// numerators w; zero weights skipped), held in NV registers over the rows: accumulated in
// memory instead, each row's load, add and store of og waits on the last row's store
// (~60% of the attention at 4,096 rows).
template <int NV>
void weighted_rows(const float* w, const float* vh, int64_t v_s, int S, float* og) {
  vf acc[NV];
  for (int i = 0; i < NV; ++i) acc[i] = vf{};
  for (int j = 0; j < S; ++j) {
    if (w[j] == 0.f) continue;  // masked (a shorter member's padding): its row is not read
    const vf wj = splat(w[j]);
    const float* vj = vh + j * v_s;
    for (int i = 0; i < NV; ++i) acc[i] += wj * load(vj + W * i);
  }
  for (int i = 0; i < NV; ++i) store(og + W * i, acc[i]);
}

// The sums of four vectors: with AVX-512, lanes folded pairwise, two vectors at a time, so
// four dot products take eight shuffles where four separate sums take sixteen; narrower
// vectors take four sums of three or fewer shuffles each.
inline void sum4(vf s0, vf s1, vf s2, vf s3, float* out) {
#if defined(__AVX512F__)
  const vf t0 = __builtin_shufflevector(s0, s1, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                        22, 23) +
                __builtin_shufflevector(s0, s1, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                                        29, 30, 31);
  const vf t1 = __builtin_shufflevector(s2, s3, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21,
                                        22, 23) +
                __builtin_shufflevector(s2, s3, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28,
                                        29, 30, 31);
  // Lanes 4i..4i+3 of u: four partial sums of s_i.
  const vf u = __builtin_shufflevector(t0, t1, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25,
                                       26, 27) +
               __builtin_shufflevector(t0, t1, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29,
                                       30, 31);
  const vf v = u + __builtin_shufflevector(u, u, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15,
                                           12, 13);
  const vf w = v + __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12,
                                           15, 14);
  out[0] = w[0];
  out[1] = w[4];
  out[2] = w[8];
  out[3] = w[12];
#else
  out[0] = hsum(s0);
  out[1] = hsum(s1);
  out[2] = hsum(s2);
  out[3] = hsum(s3);
#endif
}

// scale * q_g . k[j] for the G query heads of a KV head (q_g at q + g * q_h) over its S
// contiguous key rows of ND x W floats (k[j] at k + j * k_s), into out[g * S + j]: each key is
// read once for the group (past a few thousand rows the keys come from memory), the queries
// stay in registers, and four keys' sums are folded together (sum4). Masked keys are scored
// too (their rows exist; head() sets them to -inf): cheaper than branching per key.
template <int ND, int G>
void group_scores(const float* q, int64_t q_h, const float* k, int64_t k_s, int S, float scale,
                  float* out) {
  vf qv[G][ND];
  for (int g = 0; g < G; ++g)
    for (int i = 0; i < ND; ++i) qv[g][i] = load(q + g * q_h + W * i);
  int j = 0;
  for (; j + 4 <= S; j += 4) {
    vf part[G][4];
    for (int t = 0; t < 4; ++t) {
      const float* kj = k + (j + t) * k_s;
      vf kv[ND];
      for (int i = 0; i < ND; ++i) kv[i] = load(kj + W * i);
      for (int g = 0; g < G; ++g) {
        vf acc = qv[g][0] * kv[0];
        for (int i = 1; i < ND; ++i) acc += qv[g][i] * kv[i];
        part[g][t] = acc;
      }
    }
    for (int g = 0; g < G; ++g) {
      float* o = out + static_cast<size_t>(g) * S + j;
      sum4(part[g][0], part[g][1], part[g][2], part[g][3], o);
      for (int t = 0; t < 4; ++t) o[t] *= scale;
    }
  }
  for (; j < S; ++j) {
    const float* kj = k + j * k_s;
    for (int g = 0; g < G; ++g) {
      vf acc = qv[g][0] * load(kj);
      for (int i = 1; i < ND; ++i) acc += qv[g][i] * load(kj + W * i);
      out[static_cast<size_t>(g) * S + j] = hsum(acc) * scale;
    }
  }
}

// group_scores for the shapes it is built for (heads of 64 in groups of 1 to 4, of 128 in
// groups of 1 or 2, of 256); false where another shape must take the general loop.
bool grouped_scores(int D, int G, const float* q, int64_t q_h, const float* k, int64_t k_s,
                    int S, float scale, float* out) {
  const auto by_group = [&]<int ND>() {
    switch (G) {
      case 1: group_scores<ND, 1>(q, q_h, k, k_s, S, scale, out); return true;
      case 2: group_scores<ND, 2>(q, q_h, k, k_s, S, scale, out); return true;
      case 3: group_scores<ND, 3>(q, q_h, k, k_s, S, scale, out); return true;
      case 4: group_scores<ND, 4>(q, q_h, k, k_s, S, scale, out); return true;
      default: return false;
    }
  };
  if (D == 64) return by_group.template operator()<64 / W>();
  if (D == 128 && G <= 2) return by_group.template operator()<128 / W>();
  if (D == 256) {  // Gemma's heads: one query at a time (a group's queries fill no registers)
    for (int g = 0; g < G; ++g)
      group_scores<256 / W, 1>(q + g * q_h, q_h, k, k_s, S, scale, out + static_cast<size_t>(g) * S);
    return true;
  }
  return false;
}

// exp(p[j] - top) in place over n floats (W at a time: simd.h's vexp, about 1 ulp); their sum.
float exponentiate(float* p, int n, float top) {
  int j = 0;
  float total = 0.f;
  vf sum{};
  for (; j + W <= n; j += W) {
    const vf e = vexp(load(p + j) - top);
    store(p + j, e);
    sum += e;
  }
  total = hsum(sum);
  for (; j < n; ++j) {
    p[j] = std::exp(p[j] - top);
    total += p[j];
  }
  return total;
}

// One KV head of one sequence: its G query heads against its S keys.
// A key whose mask is false (a batch member's padding) gets no weight.
void head(const float* q, const float* k, const float* v, const bool* mask, float* out,
          const Layout& L, float scale, int b, int h, std::vector<float>& p) {
  const int G = L.Hq / L.H;
  const float* kh = k + b * L.k_b + h * L.k_h;
  const float* vh = v + b * L.v_b + h * L.v_h;
  const bool* mh = mask ? mask + b * L.m_b + h * L.m_h : nullptr;
  const float* q0 = q + b * L.q_b + h * G * L.q_h;
  p.resize(static_cast<size_t>(G) * L.S);
  const bool grouped = L.q_d == 1 && L.k_d == 1 &&  // q and each key row contiguous
                       grouped_scores(L.D, G, q0, L.q_h, kh, L.k_s, L.S, scale, p.data());
  for (int g = 0; g < G; ++g) {
    const float* qg = q0 + g * L.q_h;
    float* pg = p.data() + static_cast<size_t>(g) * L.S;
    float top = -INFINITY;
    for (int j = 0; j < L.S; ++j) {
      if (mh && !mh[j * L.m_s]) {
        pg[j] = -INFINITY;
      } else if (!grouped) {
        pg[j] = strided_dot(qg, L.q_d, kh + j * L.k_s, L.k_d, L.D) * scale;
      }
      top = std::max(top, pg[j]);
    }
    float total = 0.f;
    if (top == -INFINITY) {  // every key masked: zeros
      std::fill(pg, pg + L.S, 0.f);
    } else {
      total = exponentiate(pg, L.S, top);
    }
    float* og = out + (static_cast<int64_t>(b) * L.Hq + h * G + g) * L.Dv;
    const bool values = L.v_d == 1;  // each value row contiguous
    if (values && L.Dv == 64) {
      weighted_rows<64 / W>(pg, vh, L.v_s, L.S, og);
    } else if (values && L.Dv == 128) {
      weighted_rows<128 / W>(pg, vh, L.v_s, L.S, og);
    } else if (values && L.Dv == 256) {
      weighted_rows<256 / W>(pg, vh, L.v_s, L.S, og);
    } else {
      std::fill(og, og + L.Dv, 0.f);
      for (int j = 0; j < L.S; ++j) {
        const float w = pg[j];
        if (w == 0.f) continue;
        const float* vj = vh + j * L.v_s;
        for (int d = 0; d < L.Dv; ++d) og[d] += w * vj[d * L.v_d];
      }
    }
    const float inv = total > 0.f ? 1.f / total : 0.f;  // every key masked: zeros
    for (int d = 0; d < L.Dv; ++d) og[d] *= inv;
  }
}

class DecodeAttention : public mx::UnaryPrimitive {
 public:
  DecodeAttention(mx::Stream stream, float scale) : mx::UnaryPrimitive(stream), scale_(scale) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& q = inputs[0];
    const mx::array& k = inputs[1];
    const mx::array& v = inputs[2];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(q);
    encoder.set_input_array(k);
    encoder.set_input_array(v);
    const bool masked = inputs.size() == 4;
    if (masked) encoder.set_input_array(inputs[3]);
    encoder.set_output_array(out);
    const auto& ms = masked ? inputs[3].strides() : k.strides();
    Layout L{static_cast<int>(q.shape(0)), static_cast<int>(q.shape(1)),
             static_cast<int>(k.shape(1)), static_cast<int>(k.shape(2)),
             static_cast<int>(k.shape(3)), static_cast<int>(v.shape(3)),
             q.strides()[0], q.strides()[1], q.strides()[3],
             k.strides()[0], k.strides()[1], k.strides()[2], k.strides()[3],
             v.strides()[0], v.strides()[1], v.strides()[2], v.strides()[3],
             ms[0], ms[1], ms[2]};
    encoder.dispatch([q_ptr = q.data<float>(), k_ptr = k.data<float>(), v_ptr = v.data<float>(),
                      m_ptr = masked ? inputs[3].data<bool>() : nullptr,
                      o_ptr = out.data<float>(), L, scale = scale_]() {
      const int tasks = L.B * L.H;
      // Below ~64k multiply-adds one thread is faster than waking another.
      const bool split = static_cast<int64_t>(tasks) * L.S * (L.Hq / L.H) * L.D >= (1 << 16);
      qfserve::pool().run(split ? tasks : 1, [&](int task) {
        thread_local std::vector<float> p;
        const int first = split ? task : 0, last = split ? task + 1 : tasks;
        for (int t = first; t < last; ++t)
          head(q_ptr, k_ptr, v_ptr, m_ptr, o_ptr, L, scale, t / L.H, t % L.H, p);
      });
    });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("qfserve's decode attention runs on the CPU only");
  }

  const char* name() const override { return "QfserveDecodeAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    return scale_ == static_cast<const DecodeAttention&>(other).scale_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    return {{inputs[0].shape(0), inputs[0].shape(1), 1, inputs[2].shape(3)}};
  }

 private:
  float scale_;
};

}  // namespace

namespace qfserve {

mx::array decode_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                           float scale, const std::optional<mx::array>& key_mask,
                           mx::StreamOrDevice s) {
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4)
    throw std::invalid_argument("q, k and v must be 4-D (batch, heads, rows, dims)");
  if (q.shape(2) != 1) throw std::invalid_argument("decode attention takes one query a head");
  if (k.shape(0) != q.shape(0) || v.shape(0) != q.shape(0) || k.shape(1) != v.shape(1) ||
      k.shape(2) != v.shape(2) || k.shape(3) != q.shape(3) || q.shape(1) % k.shape(1) != 0 ||
      k.shape(2) < 1)
    throw std::invalid_argument("q, k and v shapes do not match");
  if (q.dtype() != mx::float32 || k.dtype() != mx::float32 || v.dtype() != mx::float32)
    throw std::invalid_argument("q, k and v must be float32");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  std::vector<mx::array> inputs = {q, k, v};  // read through their strides, never copied
  if (key_mask) {
    const mx::array& m = *key_mask;
    if (m.ndim() != 3 || m.shape(0) != k.shape(0) || m.shape(1) != k.shape(1) ||
        m.shape(2) != k.shape(2) || m.dtype() != mx::bool_)
      throw std::invalid_argument("key_mask must be bool (batch, kv heads, rows)");
    inputs.push_back(m);  // read through its strides: a broadcast mask is not copied
  }
  return mx::array({q.shape(0), q.shape(1), 1, v.shape(3)}, mx::float32,
                   std::make_shared<DecodeAttention>(stream, scale), std::move(inputs));
}

}  // namespace qfserve
