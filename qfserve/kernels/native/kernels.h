// qfserve's native CPU kernels, as MLX ops (each builds an array whose primitive runs on the
// CPU stream). module.cpp binds them to Python.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "mlx/mlx.h"

namespace qfserve {

// x (..., K) float32 @ the dequantized weight (N, K).T -> (..., N) float32; the weight in
// MLX's affine layout of `bits` (4, 5, 6, 8) bits, groups of 32, 64 or 128 (from the shapes).
mlx::core::array quantized_matmul(const mlx::core::array& x, const mlx::core::array& w,
                                  const mlx::core::array& scales, const mlx::core::array& biases,
                                  int bits, mlx::core::StreamOrDevice s);

// The same weight as float32 (N, K).
mlx::core::array dequantize(const mlx::core::array& w, const mlx::core::array& scales,
                            const mlx::core::array& biases, int bits,
                            mlx::core::StreamOrDevice s);

// One query per head over every key: softmax(q k^T * scale) v, with grouped KV heads.
// q (B, Hq, 1, D), k (B, H, S, D), v (B, H, S, Dv) float32, H dividing Hq -> (B, Hq, 1, Dv);
// key_mask (B, H, S) bool, false where a key may not be attended.
mlx::core::array decode_attention(const mlx::core::array& q, const mlx::core::array& k,
                                  const mlx::core::array& v, float scale,
                                  const std::optional<mlx::core::array>& key_mask,
                                  mlx::core::StreamOrDevice s);

// Causal attention of N queries over S keys that end with theirs (query i sits at key
// S - N + i): q (B, Hq, N, D), k (B, H, S, D), v (B, H, S, Dv) float32 -> (B, Hq, N, Dv);
// key_mask (B, H, S) bool, false where a key may not be attended; window > 0: query i sees
// only keys S - N + i - window < j (a sliding-window layer's).
mlx::core::array prefill_attention(const mlx::core::array& q, const mlx::core::array& k,
                                   const mlx::core::array& v, float scale,
                                   const std::optional<mlx::core::array>& key_mask, int window,
                                   mlx::core::StreamOrDevice s);

// prefill_attention, and KVzip's score of each key (B, H, S) float32: for keys in
// [score_from, score_to) (score_to < 0: to the end) where `counted` (B, H, S) bool is true,
// the max over the group's queries of its weight in a softmax over the counted keys only; 0
// elsewhere.
std::vector<mlx::core::array> reconstruction_attention(
    const mlx::core::array& q, const mlx::core::array& k, const mlx::core::array& v, float scale,
    const mlx::core::array& counted, const std::optional<mlx::core::array>& key_mask,
    int score_from, int score_to, mlx::core::StreamOrDevice s);

// mx.fast.rope's arithmetic in one op: x (B, H, T, D) float32 rotated at positions
// (t + offset) * scale by the first `dims` dimensions' inv_freqs (dims / 2, float32); offset
// int32, one or one per sequence (B,).
mlx::core::array rope(const mlx::core::array& x, const mlx::core::array& inv_freqs,
                      const mlx::core::array& offset, int dims, bool traditional, float scale,
                      mlx::core::StreamOrDevice s);

// x * rsqrt(mean(x^2 over the last dimension) + eps) * weight; x (..., D), weight (D,) float32.
mlx::core::array rms_norm(const mlx::core::array& x, const mlx::core::array& weight, float eps,
                          mlx::core::StreamOrDevice s);

// gate * sigmoid(gate) * up, element-wise; float32, the same shape.
mlx::core::array swiglu(const mlx::core::array& gate, const mlx::core::array& up,
                        mlx::core::StreamOrDevice s);
// gelu_approx(gate) * up (Gemma's MLP), gelu_approx(x) = 0.5 x (1 + tanh(sqrt(2 / pi) (x +
// 0.044715 x^3))) as MLX's nn.gelu_approx; float32, the same shape.
mlx::core::array gelu_glu(const mlx::core::array& gate, const mlx::core::array& up,
                          mlx::core::StreamOrDevice s);
// x - logsumexp(x) over the last dimension, and the first index of each row's largest result
// (uint32, x's shape less the last axis), as x - mx.logsumexp(x) and mx.argmax of it; float32.
std::vector<mlx::core::array> log_softmax(const mlx::core::array& x,
                                          mlx::core::StreamOrDevice s);

// An eviction cache's decode step at budget (qfserve/engine/kv/evict.py's write_and_select):
// the new row into the free slot, then the next victim. Returns the new keys, values, scores,
// order and free slot (and token_scores, where given, with the raw score at the slot); the
// cache's arrays are updated in place where MLX can donate them.
std::vector<mlx::core::array> evict_step(
    const mlx::core::array& keys, const mlx::core::array& values,
    const mlx::core::array& scores, const mlx::core::array& order,
    const mlx::core::array& free, const mlx::core::array& new_keys,
    const mlx::core::array& new_values, const std::optional<mlx::core::array>& new_score,
    const mlx::core::array& position, const mlx::core::array& first_recent,
    const mlx::core::array& n_sink, const std::optional<mlx::core::array>& held, bool ranked,
    const std::optional<mlx::core::array>& direction,
    const std::optional<mlx::core::array>& scale,
    const std::optional<mlx::core::array>& token_scores,
    const std::optional<mlx::core::array>& caps, const std::vector<mlx::core::array>& hidden,
    float eps, mlx::core::StreamOrDevice s);

// A decode step's block in two ops around its cache and attention (decode_block.cpp).
// decode_qkv: x (B, 1, K) float32, RMS-normalised by `norm` (K,) where given, through each
// projection's codes (w, scales, biases), each head of q and k RMS-normalised by
// `head_norms` (q's, k's: (D,) each) where given, then RoPE on q and k as rope() computes it
// -> q (B, Hq, 1, D), k (B, Hkv, 1, D), v (B, Hkv, 1, D).
std::vector<mlx::core::array> decode_qkv(
    const mlx::core::array& x, const std::vector<mlx::core::array>& q,
    const std::vector<mlx::core::array>& k, const std::vector<mlx::core::array>& v,
    const mlx::core::array& inv_freqs, const mlx::core::array& offset, int n_heads,
    int n_kv_heads, int dims, bool traditional, float scale,
    const std::optional<mlx::core::array>& norm, float eps,
    const std::vector<mlx::core::array>& head_norms, mlx::core::StreamOrDevice s);
// decode_tail: attention's output a (B, Hq, 1, D) and the block's input x (B, 1, K) ->
// h = x + post_attention(o(a)); h + post_feedforward(down(act(gate(n), up(n)))) with n = h
// RMS-normalised by `norm`, act "swiglu" or "gelu_approx" (gelu_approx(gate) * up), and each
// post norm skipped where not given.
mlx::core::array decode_tail(const mlx::core::array& a, const mlx::core::array& x,
                             const std::vector<mlx::core::array>& o,
                             const mlx::core::array& norm, float eps,
                             const std::vector<mlx::core::array>& gate,
                             const std::vector<mlx::core::array>& up,
                             const std::vector<mlx::core::array>& down,
                             const std::optional<mlx::core::array>& post_attention,
                             const std::optional<mlx::core::array>& post_feedforward,
                             const std::string& activation, mlx::core::StreamOrDevice s);
}  // namespace qfserve
