// Causal attention of a block of queries (a prompt chunk) over a layer's keys, on the CPU; and
// from the same logits, KVzip's reconstruction scores of the keys.
//
// Why by hand: MLX's CPU scaled_dot_product_attention falls back to whole ops over an
// (H, N, S) logit array, and the numpy tiles that replaced it (engine/kv/blocked.py) run on
// one thread, each tile's logits a few megabytes, so attention was two thirds of a prompt's
// prefill on the default model and four fifths of KVzip's reconstruction pass. Here each work
// item is one KV head's G query heads over a tile of T queries, walking the keys in blocks of
// KB with an online softmax (FlashAttention's), so its logits, keys and values stay in L1/L2,
// and the items run on the kernels' pool of threads.
//
//   out[g, i] = sum_{j <= S - N + i} softmax_j(scale * q[g, i] . k[j]) v[j]
//
// With a `window` W > 0 (a sliding-window layer's prompt chunk, Gemma 3's local layers: MLX
// would take its whole-array fallback with a scalar exp over every logit), only keys
// S - N + i - W < j <= S - N + i are visible to query i, and the walk starts at the tile's
// first visible block.
//
// With `counted` (B, H, S) bool, KVzip's score of every counted key j, the max over the
// queries and the group of its weight in a softmax restricted to the counted keys:
//
//   score[j] = max_{g, i} exp(l[g, i, j]) / sum_{j' counted, visible to i} exp(l[g, i, j'])
//
// which takes a second walk over the keys once a row's max and restricted sum are known. Only
// keys in [from, to) are scored (the rest score 0): the pass wants its chunk's stored rows,
// and walking every key twice cost a tenth of its attention.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "pool.h"
#include "simd.h"

namespace mx = mlx::core;
using namespace qfserve::simd;

namespace {

constexpr int KB = 64;      // keys per block: a multiple of W
constexpr int KV = KB / W;  // vectors per block of logits
constexpr int T = 16;       // queries per tile (G * T rows per work item)
#if defined(__AVX512F__)
constexpr int RB = 4;  // rows per micro-tile: 4 x KV accumulators fit AVX-512's 32 registers
#else
constexpr int RB = 2;
#endif

struct Layout {  // element strides of q, k, v, the key mask and `counted`, and the shapes
  int B, Hq, H, N, S, D, Dv;
  int window;  // keys visible to a query back from its own (0: all before it)
  int from, to;  // the keys scored
  int64_t q_b, q_h, q_n, q_d, k_b, k_h, k_s, k_d, v_b, v_h, v_s, v_d;
  int64_t m_b, m_h, m_s, c_b, c_h, c_s;
  int Sp, Dp;  // keys padded to whole blocks, value dims to whole vectors
};

// One KV head's keys and values packed once per call for all its tiles: keys transposed per
// block of KB (Sp / KB blocks of D x KB, each contiguous: rows Sp apart would alias in L1)
// so a block's logits are vector products over keys, values (Sp x Dp), and per key
// an additive bias (0, or -inf where masked or padding) and its `counted` weight (0 or 1).
struct Packed {
  float *kt, *v, *bias, *count;
};

Packed packed_head(std::vector<float>& buf, const Layout& L, int bh) {
  const size_t per = static_cast<size_t>(L.Sp) * (L.D + L.Dp + 2);
  float* base = buf.data() + per * bh;
  return {base, base + static_cast<size_t>(L.Sp) * L.D, base + static_cast<size_t>(L.Sp) * (L.D + L.Dp),
          base + static_cast<size_t>(L.Sp) * (L.D + L.Dp + 1)};
}

void pack(const Layout& L, const float* k, const float* v, const bool* mask, const bool* counted,
          int b, int h, const Packed& P) {
  const float* kh = k + b * L.k_b + h * L.k_h;
  const float* vh = v + b * L.v_b + h * L.v_h;
  for (int j = 0; j < L.Sp; ++j) {
    const bool real = j < L.S;
    const bool open = real && (!mask || mask[b * L.m_b + h * L.m_h + j * L.m_s]);
    P.bias[j] = open ? 0.f : -INFINITY;
    P.count[j] = open && counted && counted[b * L.c_b + h * L.c_h + j * L.c_s] ? 1.f : 0.f;
    const float* kj = kh + j * L.k_s;
    float* kt = P.kt + static_cast<size_t>(j / KB) * L.D * KB + j % KB;
    for (int d = 0; d < L.D; ++d) kt[d * KB] = real ? kj[d * L.k_d] : 0.f;
    const float* vj = vh + j * L.v_s;
    float* dst = P.v + static_cast<size_t>(j) * L.Dp;
    for (int d = 0; d < L.Dp; ++d) dst[d] = real && d < L.Dv ? vj[d * L.v_d] : 0.f;
  }
}

// Logits of NR packed rows (each D floats) against a block of KB transposed keys (D x KB).
template <int NR>
inline void logits(const float* q, int D, const float* kt, float* s) {
  vf acc[NR][KV] = {};
  for (int d = 0; d < D; ++d) {
    vf k[KV];
    for (int c = 0; c < KV; ++c) k[c] = load(kt + d * KB + c * W);
    for (int r = 0; r < NR; ++r) {
      const vf x = splat(q[r * D + d]);
      for (int c = 0; c < KV; ++c) acc[r][c] += x * k[c];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < KV; ++c) store(s + r * KB + c * W, acc[r][c]);
}

// acc[r] += p[r] @ v for NR rows and NC vectors of value dims: p (NR x KB), v (KB x ld),
// acc (NR x ld). The bounds are constants so the accumulators stay in registers.
template <int NR, int NC>
inline void accumulate_span(const float* p, const float* v, int ld, float* acc) {
  vf a[NR][NC];
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) a[r][c] = load(acc + r * ld + c * W);
  for (int j = 0; j < KB; ++j) {
    vf x[NC];
    for (int c = 0; c < NC; ++c) x[c] = load(v + j * ld + c * W);
    for (int r = 0; r < NR; ++r) {
      const vf w = splat(p[r * KB + j]);
      for (int c = 0; c < NC; ++c) a[r][c] += w * x[c];
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int c = 0; c < NC; ++c) store(acc + r * ld + c * W, a[r][c]);
}

// acc[r] += p[r] @ v over all Dp (a multiple of W) value dims, four vectors at a time.
template <int NR>
inline void accumulate(const float* p, const float* v, int Dp, float* acc) {
  int c0 = 0;
  for (; c0 + 4 * W <= Dp; c0 += 4 * W) accumulate_span<NR, 4>(p, v + c0, Dp, acc + c0);
  for (; c0 < Dp; c0 += W) accumulate_span<NR, 1>(p, v + c0, Dp, acc + c0);
}

// Per-thread buffers of one work item.
struct Scratch {
  std::vector<float> q, s, acc, top, total, kept, seen;  // seen: a scoring tile's logits
};

// One work item: a KV head's G query heads over a tile of up to T queries.
class Item {
 public:
  Item(const Layout& L, float scale, const float* q, const Packed& P, int b, int h, int i0,
       bool scoring, Scratch& w)
      : L_(L), P_(P), b_(b), h_(h), scoring_(scoring), w_(w) {
    G_ = L.Hq / L.H;
    rows_ = std::min(T, L.N - i0);
    R_ = G_ * rows_;
    first_ = L.S - L.N + i0;  // key position of the tile's first query
    end_ = first_ + rows_;    // keys [start_, end_) are visible to some row
    start_ = L.window > 0 ? std::max(0, first_ + 1 - L.window) / KB * KB : 0;
    // Key blocks [blo_, bhi_) hold the scored keys this tile sees; their logits are kept.
    blo_ = L.from / KB * KB;
    bhi_ = std::max(blo_, std::min((end_ + KB - 1) / KB * KB, (L.to + KB - 1) / KB * KB));
    const int Rp = (R_ + RB - 1) / RB * RB;  // rows padded to whole micro-tiles
    w.q.assign(static_cast<size_t>(Rp) * L.D, 0.f);
    w.s.resize(static_cast<size_t>(Rp) * KB);
    w.acc.assign(static_cast<size_t>(Rp) * L.Dp, 0.f);
    w.top.assign(Rp, -INFINITY);
    w.total.assign(Rp, 0.f);
    w.kept.assign(Rp, 0.f);
    if (scoring) w.seen.resize(static_cast<size_t>(R_) * (bhi_ - blo_));
    for (int g = 0; g < G_; ++g)
      for (int t = 0; t < rows_; ++t) {
        const float* src = q + b * L.q_b + (h * G_ + g) * L.q_h + (i0 + t) * L.q_n;
        float* dst = w.q.data() + static_cast<size_t>(g * rows_ + t) * L.D;
        for (int d = 0; d < L.D; ++d) dst[d] = src[d * L.q_d] * scale;
      }
  }

  // The online softmax and its weighted values over every visible key; when scoring, also
  // each row's sum over the counted keys (at the same running max), and its logits kept.
  void attend() {
    for (int j0 = start_; j0 < end_; j0 += KB) {
      block_logits(j0);
      for (int r = 0; r < R_; ++r) {
        float* s = w_.s.data() + r * KB;
        if (scoring_ && j0 >= blo_ && j0 < bhi_)
          std::memcpy(w_.seen.data() + static_cast<size_t>(r) * (bhi_ - blo_) + (j0 - blo_), s,
                      KB * 4);
        vf m = load(s);
        for (int c = 1; c < KV; ++c) m = vmax(m, load(s + c * W));
        const float block_top = hmax(m);
        if (block_top == -INFINITY) {  // nothing visible to this row here
          std::memset(s, 0, KB * sizeof(float));
          continue;
        }
        const float top = std::max(w_.top[r], block_top);
        // 0 on the row's first block; 1 (no rescale) while the row's max holds.
        const float alpha = top == w_.top[r] ? 1.f : std::exp(w_.top[r] - top);
        w_.top[r] = top;
        vf sum{}, kept{};
        for (int c = 0; c < KV; ++c) {
          const vf p = vexp(load(s + c * W) - top);
          store(s + c * W, p);
          sum += p;
          if (scoring_) kept += p * load(P_.count + j0 + c * W);
        }
        w_.total[r] = w_.total[r] * alpha + hsum(sum);
        w_.kept[r] = w_.kept[r] * alpha + hsum(kept);
        if (alpha != 1.f) {
          float* a = w_.acc.data() + static_cast<size_t>(r) * L_.Dp;
          for (int c = 0; c < L_.Dp; c += W) store(a + c, load(a + c) * alpha);
        }
      }
      const float* v = P_.v + static_cast<size_t>(j0) * L_.Dp;
      int r = 0;
      for (; r + RB <= R_; r += RB)
        accumulate<RB>(w_.s.data() + r * KB, v, L_.Dp, w_.acc.data() + r * L_.Dp);
      for (; r < R_; ++r) accumulate<1>(w_.s.data() + r * KB, v, L_.Dp, w_.acc.data() + r * L_.Dp);
    }
  }

  void write(float* out) const {
    const int i0 = first_ - (L_.S - L_.N);
    for (int r = 0; r < R_; ++r) {
      const int g = r / rows_, t = r % rows_;
      float* o = out + ((static_cast<int64_t>(b_) * L_.Hq + h_ * G_ + g) * L_.N + i0 + t) * L_.Dv;
      const float inv = w_.total[r] > 0.f ? 1.f / w_.total[r] : 0.f;  // all masked: zeros
      const float* a = w_.acc.data() + static_cast<size_t>(r) * L_.Dp;
      for (int d = 0; d < L_.Dv; ++d) o[d] = a[d] * inv;
    }
  }

  // Each counted key's max weight over the rows in the softmax over counted keys only, into
  // best[from, min(to, end_)), from the logits attend() kept (the rows' max and counted sums
  // are final).
  // A weight is exp(logit - top - log(kept)), monotonic in its exponent: the max over rows
  // is taken before the one exp a key.
  void score(float* best) {
    for (int r = 0; r < R_; ++r)  // the row's log normaliser (-inf: it counts nothing)
      w_.kept[r] = w_.kept[r] > 0.f ? w_.top[r] + std::log(w_.kept[r]) : INFINITY;
    for (int j0 = blo_; j0 < bhi_; j0 += KB) {
      vf cols[KV];
      for (int c = 0; c < KV; ++c) cols[c] = splat(-INFINITY);
      for (int r = 0; r < R_; ++r) {
        const float* s = w_.seen.data() + static_cast<size_t>(r) * (bhi_ - blo_) + (j0 - blo_);
        for (int c = 0; c < KV; ++c) cols[c] = vmax(cols[c], load(s + c * W) - w_.kept[r]);
      }
      const int lo = std::max(j0, L_.from), hi = std::min({j0 + KB, end_, L_.to});
      for (int c = 0; c < KV; ++c) {
        // <= 0 on counted keys (a weight <= 1); others are zeroed, so clamp them first.
        const vf x = cols[c] < 0.f ? cols[c] : vf{};
        const vf got = vexp(x) * load(P_.count + j0 + c * W);
        for (int i = 0; i < W; ++i) {
          const int j = j0 + c * W + i;
          if (j >= lo && j < hi) best[j] = std::max(best[j], got[i]);
        }
      }
    }
  }

 private:
  // Logits of every row against keys [j0, j0 + KB): -inf where masked, past the end, after
  // the row's own position, or (with a window) a window or more before it.
  void block_logits(int j0) {
    const float* kt = P_.kt + static_cast<size_t>(j0) * L_.D;  // block j0 / KB
    int r = 0;
    for (; r + RB <= R_; r += RB)
      logits<RB>(w_.q.data() + r * L_.D, L_.D, kt, w_.s.data() + r * KB);
    for (; r < R_; ++r) logits<1>(w_.q.data() + r * L_.D, L_.D, kt, w_.s.data() + r * KB);
    for (r = 0; r < R_; ++r) {
      float* s = w_.s.data() + r * KB;
      for (int c = 0; c < KV; ++c) store(s + c * W, load(s + c * W) + load(P_.bias + j0 + c * W));
      const int own = first_ + r % rows_;  // the row's key position: later keys are hidden
      for (int j = std::max(0, own + 1 - j0); j < KB; ++j) s[j] = -INFINITY;
      if (L_.window > 0)
        for (int j = 0, stop = std::min(KB, own + 1 - L_.window - j0); j < stop; ++j)
          s[j] = -INFINITY;
    }
  }

  const Layout& L_;
  const Packed& P_;
  int b_, h_, G_, rows_, R_, first_, start_, end_, blo_, bhi_;
  bool scoring_;
  Scratch& w_;
};

class PrefillAttention : public mx::Primitive {
 public:
  PrefillAttention(mx::Stream stream, float scale, bool masked, bool scored, int from, int to,
                   int window)
      : mx::Primitive(stream), scale_(scale), masked_(masked), scored_(scored), from_(from),
        to_(to), window_(window) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    const mx::array& q = inputs[0];
    const mx::array& k = inputs[1];
    const mx::array& v = inputs[2];
    const mx::array* mask = masked_ ? &inputs[3] : nullptr;
    const mx::array* counted = scored_ ? &inputs[masked_ ? 4 : 3] : nullptr;
    for (auto& o : outputs) o.set_data(mx::allocator::malloc(o.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : inputs) encoder.set_input_array(a);
    for (auto& o : outputs) encoder.set_output_array(o);
    const auto& ms = mask ? mask->strides() : k.strides();
    const auto& cs = counted ? counted->strides() : k.strides();
    Layout L{static_cast<int>(q.shape(0)), static_cast<int>(q.shape(1)),
             static_cast<int>(k.shape(1)), static_cast<int>(q.shape(2)),
             static_cast<int>(k.shape(2)), static_cast<int>(k.shape(3)),
             static_cast<int>(v.shape(3)), window_, from_, to_,
             q.strides()[0], q.strides()[1], q.strides()[2], q.strides()[3],
             k.strides()[0], k.strides()[1], k.strides()[2], k.strides()[3],
             v.strides()[0], v.strides()[1], v.strides()[2], v.strides()[3],
             ms[0], ms[1], ms[2], cs[0], cs[1], cs[2],
             static_cast<int>((k.shape(2) + KB - 1) / KB * KB),
             static_cast<int>((v.shape(3) + W - 1) / W * W)};
    encoder.dispatch([q_ptr = q.data<float>(), k_ptr = k.data<float>(), v_ptr = v.data<float>(),
                      m_ptr = mask ? mask->data<bool>() : nullptr,
                      c_ptr = counted ? counted->data<bool>() : nullptr,
                      o_ptr = outputs[0].data<float>(),
                      s_ptr = scored_ ? outputs[1].data<float>() : nullptr, L,
                      scale = scale_]() {
      const int heads = L.B * L.H;
      const int tiles = (L.N + T - 1) / T;
      const int items = heads * tiles;
      // Reused across calls (this is the stream's thread): no fresh pages every layer.
      thread_local std::vector<float> packed, partial;
      packed.resize(static_cast<size_t>(heads) * L.Sp * (L.D + L.Dp + 2));
      std::vector<Packed> heads_packed;
      for (int bh = 0; bh < heads; ++bh) heads_packed.push_back(packed_head(packed, L, bh));
      qfserve::pool().run(heads, [&](int bh) {
        pack(L, k_ptr, v_ptr, m_ptr, c_ptr, bh / L.H, bh % L.H, heads_packed[bh]);
      });
      // Each item's scores apart (tiles of one head share keys), maxed together after.
      if (s_ptr) partial.assign(static_cast<size_t>(items) * L.S, 0.f);
      float* best = partial.data();  // (thread_local: the pool's threads would see their own)
      qfserve::pool().run(items, [&](int item) {
        thread_local Scratch scratch;
        const int bh = item / tiles;
        const int tile = tiles - 1 - item % tiles;  // the longest (last) tiles first
        Item it(L, scale, q_ptr, heads_packed[bh], bh / L.H, bh % L.H, tile * T,
                s_ptr != nullptr, scratch);
        it.attend();
        it.write(o_ptr);
        if (s_ptr) it.score(best + static_cast<size_t>(item) * L.S);
      });
      if (s_ptr) {
        for (int bh = 0; bh < heads; ++bh) {
          float* dst = s_ptr + static_cast<size_t>(bh) * L.S;
          std::fill(dst, dst + L.S, 0.f);
          for (int t = 0; t < tiles; ++t) {
            const float* src = best + (static_cast<size_t>(bh) * tiles + t) * L.S;
            for (int j = L.from; j < L.to; ++j) dst[j] = std::max(dst[j], src[j]);
          }
        }
      }
    });
  }

  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("qfserve's prefill attention runs on the CPU only");
  }

  const char* name() const override { return "QfservePrefillAttention"; }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const PrefillAttention&>(other);
    return scale_ == o.scale_ && masked_ == o.masked_ && scored_ == o.scored_ &&
           from_ == o.from_ && to_ == o.to_ && window_ == o.window_;
  }

  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override {
    const auto& q = inputs[0];
    const auto& k = inputs[1];
    std::vector<mx::Shape> shapes = {{q.shape(0), q.shape(1), q.shape(2), inputs[2].shape(3)}};
    if (scored_) shapes.push_back({k.shape(0), k.shape(1), k.shape(2)});
    return shapes;
  }

 private:
  float scale_;
  bool masked_, scored_;
  int from_, to_;  // the keys scored
  int window_;      // 0: causal only
};

void check_mask(const mx::array& m, const mx::array& k, const char* what) {
  if (m.ndim() != 3 || m.shape(0) != k.shape(0) || m.shape(1) != k.shape(1) ||
      m.shape(2) != k.shape(2) || m.dtype() != mx::bool_)
    throw std::invalid_argument(std::string(what) + " must be bool (batch, kv heads, rows)");
}

std::vector<mx::array> prefill(const mx::array& q, const mx::array& k, const mx::array& v,
                               float scale, const std::optional<mx::array>& key_mask,
                               const std::optional<mx::array>& counted, int from, int to,
                               int window, mx::StreamOrDevice s) {
  if (q.ndim() != 4 || k.ndim() != 4 || v.ndim() != 4)
    throw std::invalid_argument("q, k and v must be 4-D (batch, heads, rows, dims)");
  if (k.shape(0) != q.shape(0) || v.shape(0) != q.shape(0) || k.shape(1) != v.shape(1) ||
      k.shape(2) != v.shape(2) || k.shape(3) != q.shape(3) || q.shape(1) % k.shape(1) != 0 ||
      q.shape(2) < 1 || q.shape(2) > k.shape(2))
    throw std::invalid_argument("q, k and v shapes do not match (need 1 <= N <= S)");
  if (q.dtype() != mx::float32 || k.dtype() != mx::float32 || v.dtype() != mx::float32)
    throw std::invalid_argument("q, k and v must be float32");
  if (window < 0 || (window > 0 && counted))
    throw std::invalid_argument("window must be >= 0, and 0 where keys are scored");
  std::vector<mx::array> inputs = {q, k, v};  // read through their strides, never copied
  if (key_mask) {
    check_mask(*key_mask, k, "key_mask");
    inputs.push_back(*key_mask);
  }
  if (counted) {
    check_mask(*counted, k, "counted");
    inputs.push_back(*counted);
  }
  std::vector<mx::Shape> shapes = {{q.shape(0), q.shape(1), q.shape(2), v.shape(3)}};
  std::vector<mx::Dtype> dtypes = {mx::float32};
  if (counted) {
    shapes.push_back({k.shape(0), k.shape(1), k.shape(2)});
    dtypes.push_back(mx::float32);
  }
  const int S = k.shape(2);
  to = to < 0 ? S : std::min(to, S);
  from = std::clamp(from, 0, to);
  auto primitive = std::make_shared<PrefillAttention>(mx::to_stream(s, mx::Device::cpu), scale,
                                                      key_mask.has_value(), counted.has_value(),
                                                      from, to, window);
  return mx::array::make_arrays(std::move(shapes), dtypes, primitive, inputs);
}

}  // namespace

namespace qfserve {

mx::array prefill_attention(const mx::array& q, const mx::array& k, const mx::array& v,
                            float scale, const std::optional<mx::array>& key_mask, int window,
                            mx::StreamOrDevice s) {
  return prefill(q, k, v, scale, key_mask, std::nullopt, 0, -1, window, s)[0];
}

std::vector<mx::array> reconstruction_attention(const mx::array& q, const mx::array& k,
                                                const mx::array& v, float scale,
                                                const mx::array& counted,
                                                const std::optional<mx::array>& key_mask,
                                                int score_from, int score_to,
                                                mx::StreamOrDevice s) {
  return prefill(q, k, v, scale, key_mask, counted, score_from, score_to, 0, s);
}

}  // namespace qfserve
