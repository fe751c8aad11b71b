// A decode step of an eviction cache at its budget, on the CPU, in one op: the new row goes
// into the free slot, then the next victim is chosen (qfserve/engine/kv/evict.py,
// write_and_select, is the reference and the path everywhere else).
//
// Why by hand: compiled with mx.compile, that step is still about a dozen primitives (four
// scatters, a where, a min, an argmax, ...), each evaluated on its own on MLX's CPU backend:
// ~75 us a layer, ~2.3 ms of a ~20 ms SmolLM2 step, where a plain KVCache writes one slice.
// Here it is three: the new row written into the keys and into the values, in place when MLX
// can give up their buffers (it can when the cache holds no other reference, as in a decode
// step; one op per array, since a multi-output op's inputs are referenced by each output), and
// the scores, order and next victim, small arrays, in a third. Where the scorer is a
// projection (Q-Filters, key-SVD: score = (k . direction[h]) * scale[h]), the third op also
// computes the new row's score from its key: scored apart, that is a matmul and a multiply a
// layer, ~30 us a layer on MLX's CPU, as much again as the rest of the step. Where it is a
// linear map of the hidden state that entered the layer (KVzap's linear surrogate: score =
// bias[h] + rms_norm(x) . weight[h]), the third op computes that from the row of x: apart,
// the norm, a BLAS product of one row and a transpose cost ~50 us a layer.
//
//   slot = free[b, h]; keys[.., slot] = k; values[.., slot] = v; order[.., slot] = position
//   scores[.., slot] = score (NaN -> -inf when `ranked`), or sum_d k[d] * direction[d] * scale,
//                      or bias[h] + sum_d (x[d] * norm[d] / rms(x)) * weight[h, d]
//   token_scores[.., slot] = the score, raw (where given: a chunked cache's per-token scores)
//   guarded(c) = c < n_sink | order[c] >= first_recent | c >= held
//   free' = argmax over {c : rank(c) == min over unguarded (inf if guarded)} of order[c],
//           or held where held < caps (a packed member still growing takes its next slot)
// where rank = scores, NaN read as -inf.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "detail.h"
#include "kernels.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/primitives.h"
#include "rows.h"

namespace mx = mlx::core;

namespace {

// Element offset of a per-sequence scalar input: one value, or (B, 1, 1).
inline int64_t at(const mx::array& a, int b) { return a.size() == 1 ? 0 : b * a.strides()[0]; }

// Element offset of index i of a (B, H, C, ...) array's row (b, h), for any strides.
inline int64_t row_offset(const mx::array& a, int b, int h) {
  return b * a.strides()[0] + h * a.strides()[1];
}

// `out` takes `in`'s own buffer when MLX may give it up (returns false), else a new one
// that copy_into fills when the inputs are ready (returns true).
bool take(const mx::array& in, mx::array& out) {
  if (in.is_donatable() && in.flags().row_contiguous && in.itemsize() == out.itemsize()) {
    out.copy_shared_buffer(in);
    return false;
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  return true;
}

// `in`'s elements into `out`, contiguous, for any strides.
void copy_into(const mx::array& in, mx::array& out) {
  const size_t item = in.itemsize();
  if (in.flags().row_contiguous) {
    std::memcpy(out.data<char>(), in.data<char>(), in.size() * item);
    return;
  }
  const int64_t last = in.shape(in.ndim() - 1), ls = in.strides().back();
  const std::vector<int64_t> starts = qfserve::row_starts(in);
  const char* src = in.data<char>();
  char* dst = out.data<char>();
  for (size_t r = 0; r < starts.size(); ++r)
    for (int64_t i = 0; i < last; ++i)
      std::memcpy(dst + (r * last + i) * item, src + (starts[r] + i * ls) * item, item);
}

// cache (B, H, C, D) with row[b, h] written at slot free[b, h].
class WriteRow : public mx::UnaryPrimitive {
 public:
  explicit WriteRow(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& in, mx::array& out) override {
    const bool copied = take(in[0], out);
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : in) encoder.set_input_array(a);
    encoder.set_output_array(out);
    encoder.dispatch([in, out, copied]() mutable {
      if (copied) copy_into(in[0], out);
      const int B = in[0].shape(0), H = in[0].shape(1), C = in[0].shape(2), D = in[0].shape(3);
      float* cache = out.data<float>();
      for (int b = 0; b < B; ++b)
        for (int h = 0; h < H; ++h) {
          const uint32_t slot = in[1].data<uint32_t>()[row_offset(in[1], b, h)];
          const float* row = in[2].data<float>() + row_offset(in[2], b, h);
          float* dst = cache + ((static_cast<int64_t>(b) * H + h) * C + slot) * D;
          for (int d = 0; d < D; ++d) dst[d] = row[d * in[2].strides()[3]];
        }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("qfserve's eviction step runs on the CPU only");
  }
  const char* name() const override { return "QfserveWriteRow"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    return {in[0].shape()};
  }
};

// scores and order with the new row's at its slot, and the next victim.
class Select : public mx::Primitive {
 public:
  Select(mx::Stream stream, bool ranked, bool held, bool project, bool scaled, bool hidden,
         float eps, bool tokens, bool caps)
      : mx::Primitive(stream), ranked_(ranked), held_(held), project_(project), scaled_(scaled),
        hidden_(hidden), eps_(eps), tokens_(tokens), caps_(caps) {}

  void eval_cpu(const std::vector<mx::array>& in, std::vector<mx::array>& out) override {
    // in: scores, order, free, then the score (B, H, 1), or the new keys (B, H, 1, D), the
    // direction (H, D) or (B, H, D)[ and the scale (H, 1) or (B, H, 1)], or the hidden row
    // x (B, 1, K), its norm's weight (K), the weight (H, K) and the bias (H, 1); then
    // position, first_recent, n_sink[, held[, caps]][, token_scores]
    for (auto& o : out) o.set_data(mx::allocator::malloc(o.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto& a : in) encoder.set_input_array(a);
    for (auto& o : out) encoder.set_output_array(o);
    encoder.dispatch([in, out, ranked = ranked_, held = held_, project = project_,
                      scaled = scaled_, hidden = hidden_, eps = eps_, tokens = tokens_,
                      caps = caps_]() mutable {
      copy_into(in[0], out[0]);
      copy_into(in[1], out[1]);
      // Per-token scores (chunks): the raw score at the slot, beside the ranks.
      float* token_scores = nullptr;
      if (tokens) {
        copy_into(in.back(), out[3]);
        token_scores = out[3].data<float>();
      }
      const int B = in[0].shape(0), H = in[0].shape(1), C = in[0].shape(2);
      // position, first_recent, n_sink
      const size_t ints = 3 + (project ? 2 + scaled : hidden ? 4 : 1);
      float* scores = out[0].data<float>();
      int32_t* order = out[1].data<int32_t>();
      uint32_t* next = out[2].data<uint32_t>();
      const float inf = std::numeric_limits<float>::infinity();
      // The hidden row of sequence b, normalised (hidden scores only).
      const int64_t K = hidden ? in[4].size() : 0;
      std::vector<float> normed(K), row(K), weight(K);
      for (int64_t i = 0; i < K; ++i) weight[i] = in[4].data<float>()[i * in[4].strides()[0]];
      auto normalise = [&](int b) {
        const mx::array& x = in[3];
        const float* xb = x.data<float>() + b * x.strides()[0];
        for (int64_t i = 0; i < K; ++i) row[i] = xb[i * x.strides()[2]];
        qfserve::detail::rms_row(row.data(), weight.data(), normed.data(), K, eps);
      };
      // The new row's score at (b, h): given, its key's projection, or its hidden row's map.
      auto new_score = [&](int b, int h) {
        if (hidden) {
          const mx::array &w = in[5], &bias = in[6];
          const int64_t ws = w.strides()[1];
          const float* wh = w.data<float>() + h * w.strides()[0];
          float dot = 0.0f;
          for (int64_t i = 0; i < K; ++i) dot += normed[i] * wh[i * ws];
          return dot + bias.data<float>()[h * bias.strides()[0]];
        }
        if (!project) return in[3].data<float>()[row_offset(in[3], b, h)];
        const mx::array &k = in[3], &dir = in[4];
        const int D = k.shape(3);
        const float* key = k.data<float>() + row_offset(k, b, h);
        const float* d = dir.data<float>() + per_head(dir, b, h);
        const int64_t ks = k.strides()[3], ds = dir.strides().back();
        float dot = 0.0f;
        for (int i = 0; i < D; ++i) dot += key[i * ks] * d[i * ds];
        return scaled ? dot * in[5].data<float>()[per_head(in[5], b, h)] : dot;
      };
      for (int b = 0; b < B; ++b) {
        const int32_t position = in[ints].data<int32_t>()[at(in[ints], b)];
        const int32_t first_recent = in[ints + 1].data<int32_t>()[at(in[ints + 1], b)];
        const int32_t n_sink = in[ints + 2].data<int32_t>()[at(in[ints + 2], b)];
        const int32_t hold = held ? in[ints + 3].data<int32_t>()[at(in[ints + 3], b)] : C;
        // A member holding fewer slots than its cap grows into the next one: no victim.
        const int32_t cap = caps ? in[ints + 4].data<int32_t>()[at(in[ints + 4], b)] : hold;
        if (hidden) normalise(b);
        for (int h = 0; h < H; ++h) {
          const int64_t bh = static_cast<int64_t>(b) * H + h;
          const uint32_t slot = in[2].data<uint32_t>()[row_offset(in[2], b, h)];
          float score = new_score(b, h);
          if (tokens) token_scores[bh * C + slot] = score;
          if (ranked && std::isnan(score)) score = -inf;
          scores[bh * C + slot] = score;
          order[bh * C + slot] = position;
          if (hold < cap) {
            next[bh] = static_cast<uint32_t>(hold);
            continue;
          }
          // The victim: the lowest rank among unguarded slots, the highest order on ties.
          const float* s = scores + bh * C;
          const int32_t* o = order + bh * C;
          // One walk: a lower rank takes over; an equal one, if it is later.
          float low = inf;
          int32_t best_order = -1;
          uint32_t best = 0;
          for (int c = 0; c < C; ++c) {
            const bool guarded = c < n_sink || o[c] >= first_recent || c >= hold;
            const float r = guarded ? inf : (std::isnan(s[c]) ? -inf : s[c]);
            if (r < low || (r == low && o[c] > best_order)) low = r, best_order = o[c], best = c;
          }
          next[bh] = best;
        }
      }
    });
  }
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("qfserve's eviction step runs on the CPU only");
  }
  const char* name() const override { return "QfserveEvictSelect"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const Select&>(other);
    return ranked_ == o.ranked_ && held_ == o.held_ && project_ == o.project_ &&
           scaled_ == o.scaled_ && hidden_ == o.hidden_ && eps_ == o.eps_ &&
           tokens_ == o.tokens_ && caps_ == o.caps_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& in) override {
    if (tokens_) return {in[0].shape(), in[1].shape(), in[2].shape(), in[0].shape()};
    return {in[0].shape(), in[1].shape(), in[2].shape()};
  }

 private:
  // Element offset of head h's (D) or (1) row of a per-head array, (H, ...) or (B, H, ...).
  static int64_t per_head(const mx::array& a, int b, int h) {
    return a.ndim() == 2 ? h * a.strides()[0] : row_offset(a, b, h);
  }

  bool ranked_, held_, project_, scaled_, hidden_;
  float eps_;
  bool tokens_, caps_;
};

}  // namespace

namespace qfserve {

std::vector<mx::array> evict_step(const mx::array& keys, const mx::array& values,
                                  const mx::array& scores, const mx::array& order,
                                  const mx::array& free, const mx::array& new_keys,
                                  const mx::array& new_values,
                                  const std::optional<mx::array>& new_score,
                                  const mx::array& position, const mx::array& first_recent,
                                  const mx::array& n_sink, const std::optional<mx::array>& held,
                                  bool ranked, const std::optional<mx::array>& direction,
                                  const std::optional<mx::array>& scale,
                                  const std::optional<mx::array>& token_scores,
                                  const std::optional<mx::array>& caps,
                                  const std::vector<mx::array>& hidden, float eps,
                                  mx::StreamOrDevice s) {
  if (keys.ndim() != 4 || values.ndim() != 4 || new_keys.ndim() != 4 || new_values.ndim() != 4)
    throw std::invalid_argument("keys, values and the new row's must be 4-D (B, H, C, D)");
  const int B = keys.shape(0), H = keys.shape(1), C = keys.shape(2), D = keys.shape(3);
  const mx::Shape rows = {B, H, C}, one = {B, H, 1};
  if (values.shape(0) != B || values.shape(1) != H || values.shape(2) != C ||
      scores.shape() != rows || order.shape() != rows || free.shape() != one ||
      new_keys.shape() != mx::Shape{B, H, 1, D} ||
      new_values.shape() != mx::Shape{B, H, 1, values.shape(3)} ||
      (new_score && new_score->shape() != one) ||
      (token_scores && (token_scores->shape() != rows || token_scores->dtype() != mx::float32)))
    throw std::invalid_argument("the cache's arrays and the new row do not match");
  if (keys.dtype() != mx::float32 || values.dtype() != mx::float32 ||
      scores.dtype() != mx::float32 || new_keys.dtype() != mx::float32 ||
      new_values.dtype() != mx::float32 || (new_score && new_score->dtype() != mx::float32) ||
      order.dtype() != mx::int32 || free.dtype() != mx::uint32)
    throw std::invalid_argument("keys, values and scores must be float32, order int32, "
                                "free uint32");
  if (!hidden.empty() && hidden.size() != 4)
    throw std::invalid_argument("hidden is (x, norm, weight, bias)");
  if (int(new_score.has_value()) + int(direction.has_value()) + int(!hidden.empty()) != 1 ||
      (scale && !direction))
    throw std::invalid_argument("give the new row's score, the direction (and scale) to "
                                "project its key on, or the hidden row and its map");
  if (!hidden.empty()) {
    const mx::array &x = hidden[0], &norm = hidden[1], &weight = hidden[2], &bias = hidden[3];
    const int K = norm.size();
    for (const mx::array* a : {&x, &norm, &weight, &bias})
      if (a->dtype() != mx::float32)
        throw std::invalid_argument("hidden's x, norm, weight and bias must be float32");
    if (norm.ndim() != 1 || x.shape() != mx::Shape{B, 1, K} ||
        weight.shape() != mx::Shape{H, K} || bias.shape() != mx::Shape{H, 1})
      throw std::invalid_argument("hidden: x (B, 1, K), norm (K), weight (H, K), bias (H, 1)");
  }
  // A per-head array of the projection: (H, n) or (B, H, n), float32.
  auto per_head = [&](const mx::array& a, int n) {
    return a.dtype() == mx::float32 &&
           (a.shape() == mx::Shape{H, n} || a.shape() == mx::Shape{B, H, n});
  };
  if ((direction && !per_head(*direction, D)) || (scale && !per_head(*scale, 1)))
    throw std::invalid_argument("direction must be float32 (H, D) or (B, H, D), scale "
                                "(H, 1) or (B, H, 1)");
  auto stream = mx::to_stream(s, mx::Device::cpu);
  std::vector<mx::array> inputs = {scores, order, free};
  if (direction) {
    inputs.insert(inputs.end(), {new_keys, *direction});
    if (scale) inputs.push_back(*scale);
  } else if (!hidden.empty()) {
    inputs.insert(inputs.end(), hidden.begin(), hidden.end());
  } else {
    inputs.push_back(*new_score);
  }
  if (caps && !held) throw std::invalid_argument("caps need held");
  for (const mx::array* a : {&position, &first_recent, &n_sink, held ? &*held : nullptr,
                             caps ? &*caps : nullptr}) {
    if (a == nullptr) continue;
    if (a->dtype() != mx::int32 || (a->size() != 1 && a->shape() != mx::Shape{B, 1, 1}))
      throw std::invalid_argument("position, first_recent, n_sink, held and caps must be "
                                  "int32, one or (B, 1, 1)");
    inputs.push_back(*a);
  }
  std::vector<mx::Shape> shapes = {rows, rows, one};
  std::vector<mx::Dtype> dtypes = {mx::float32, mx::int32, mx::uint32};
  if (token_scores) {
    inputs.push_back(*token_scores);
    shapes.push_back(rows);
    dtypes.push_back(mx::float32);
  }
  auto selected = mx::array::make_arrays(
      std::move(shapes), std::move(dtypes),
      std::make_shared<Select>(stream, ranked, held.has_value(), direction.has_value(),
                               scale.has_value(), !hidden.empty(), eps,
                               token_scores.has_value(), caps.has_value()),
      inputs);
  std::vector<mx::array> out = {
      mx::array(keys.shape(), mx::float32, std::make_shared<WriteRow>(stream),
                {keys, free, new_keys}),
      mx::array(values.shape(), mx::float32, std::make_shared<WriteRow>(stream),
                {values, free, new_values})};
  out.insert(out.end(), selected.begin(), selected.end());
  return out;
}

}  // namespace qfserve
