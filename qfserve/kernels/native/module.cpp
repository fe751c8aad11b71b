// The Python module of qfserve's native CPU kernels (see kernels.h and each kernel's source).
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>
#include <nanobind/stl/vector.h>

#include "detail.h"
#include "kernels.h"
#include "pool.h"

namespace nb = nanobind;

NB_MODULE(_native, m) {
  m.doc() = "qfserve's native CPU kernels (see qfserve/kernels/native).";
  m.def("quantized_matmul", &qfserve::quantized_matmul, nb::arg("x"), nb::arg("w"),
        nb::arg("scales"), nb::arg("biases"), nb::arg("bits"), nb::kw_only(),
        nb::arg("stream") = nb::none(),
        "x (..., K) float32 @ the dequantized w (N, K).T -> (..., N) float32; MLX's affine "
        "codes of 4, 5, 6 or 8 bits in groups of 32, 64 or 128, float32 scales and biases.");
  m.def("dequantize", &qfserve::dequantize, nb::arg("w"), nb::arg("scales"), nb::arg("biases"),
        nb::arg("bits"), nb::kw_only(), nb::arg("stream") = nb::none(),
        "The codes quantized_matmul reads, as a float32 (N, K) weight.");
  m.def("decode_attention", &qfserve::decode_attention, nb::arg("q"), nb::arg("k"),
        nb::arg("v"), nb::arg("scale"), nb::kw_only(), nb::arg("key_mask") = nb::none(),
        nb::arg("stream") = nb::none(),
        "softmax(q k^T * scale) v for one query per head, KV heads grouped; key_mask "
        "(B, H, S) bool is false on keys not to attend.");
  m.def("prefill_attention", &qfserve::prefill_attention, nb::arg("q"), nb::arg("k"),
        nb::arg("v"), nb::arg("scale"), nb::kw_only(), nb::arg("key_mask") = nb::none(),
        nb::arg("window") = 0, nb::arg("stream") = nb::none(),
        "Causal softmax(q k^T * scale) v for a block of queries whose positions end the keys; "
        "KV heads grouped; key_mask (B, H, S) bool is false on keys not to attend; window > 0: "
        "each query sees its last `window` positions only (a sliding-window layer).");
  m.def("reconstruction_attention", &qfserve::reconstruction_attention, nb::arg("q"),
        nb::arg("k"), nb::arg("v"), nb::arg("scale"), nb::arg("counted"), nb::kw_only(),
        nb::arg("key_mask") = nb::none(), nb::arg("score_from") = 0, nb::arg("score_to") = -1,
        nb::arg("stream") = nb::none(),
        "prefill_attention's output and each counted key's max weight (B, H, S) over the "
        "group's queries in a softmax over the counted keys only (KVzip's score), for keys in "
        "[score_from, score_to) (score_to < 0: to the end); 0 elsewhere.");
  m.def("rope", &qfserve::rope, nb::arg("x"), nb::arg("inv_freqs"), nb::arg("offset"),
        nb::arg("dims"), nb::kw_only(), nb::arg("traditional") = false, nb::arg("scale") = 1.0f,
        nb::arg("stream") = nb::none(),
        "mx.fast.rope's arithmetic in one op: x (B, H, T, D) float32 rotated at positions "
        "(t + offset) * scale; offset int32, one or one per sequence.");
  m.def("rms_norm", &qfserve::rms_norm, nb::arg("x"), nb::arg("weight"), nb::arg("eps"),
        nb::kw_only(), nb::arg("stream") = nb::none(),
        "x * rsqrt(mean(x^2 over the last dimension) + eps) * weight, float32.");
  m.def("swiglu", &qfserve::swiglu, nb::arg("gate"), nb::arg("up"), nb::kw_only(),
        nb::arg("stream") = nb::none(), "gate * sigmoid(gate) * up, element-wise, float32.");
  m.def("gelu_glu", &qfserve::gelu_glu, nb::arg("gate"), nb::arg("up"), nb::kw_only(),
        nb::arg("stream") = nb::none(),
        "gelu_approx(gate) * up, element-wise, float32 (MLX's nn.gelu_approx's formula).");
  m.def("log_softmax", &qfserve::log_softmax, nb::arg("x"), nb::kw_only(),
        nb::arg("stream") = nb::none(),
        "(x - logsumexp(x), argmax of that) over the last dimension, float32 and uint32: as "
        "MLX's x - mx.logsumexp(x, axis=-1, keepdims=True) and mx.argmax(..., axis=-1).");
  m.def("evict_step", &qfserve::evict_step, nb::arg("keys"), nb::arg("values"),
        nb::arg("scores"), nb::arg("order"), nb::arg("free"), nb::arg("new_keys"),
        nb::arg("new_values"), nb::arg("new_score").none(), nb::arg("position"),
        nb::arg("first_recent"), nb::arg("n_sink"), nb::kw_only(),
        nb::arg("held") = nb::none(), nb::arg("ranked") = true,
        nb::arg("direction") = nb::none(), nb::arg("scale") = nb::none(),
        nb::arg("token_scores") = nb::none(), nb::arg("caps") = nb::none(),
        nb::arg("hidden") = std::vector<mlx::core::array>{}, nb::arg("eps") = 1e-6f,
        nb::arg("stream") = nb::none(),
        "An eviction cache's decode step at budget: the new row into the free slot, then the "
        "next victim; returns (keys, values, scores, order, free[, token_scores]). new_score "
        "None: the new row's score is its key . direction (H, D) or (B, H, D), times scale "
        "where given, or with hidden = (x (B, 1, K), norm (K), weight (H, K), bias (H, 1)), "
        "bias + rms_norm(x, norm, eps) . weight; token_scores (chunks) get the raw score at the slot; where held < caps "
        "(B, 1, 1), the next slot is held (a packed member still growing).");
  m.def("decode_qkv", &qfserve::decode_qkv, nb::arg("x"), nb::arg("q"), nb::arg("k"),
        nb::arg("v"), nb::arg("inv_freqs"), nb::arg("offset"), nb::arg("n_heads"),
        nb::arg("n_kv_heads"), nb::arg("dims"), nb::kw_only(), nb::arg("traditional") = false,
        nb::arg("scale") = 1.0f, nb::arg("norm") = nb::none(), nb::arg("eps") = 1e-6f,
        nb::arg("head_norms") = std::vector<mlx::core::array>{}, nb::arg("stream") = nb::none(),
        "A decode step's q, k, v in one op: x (B, 1, K) float32, RMS-normalised by norm "
        "where given, through each projection's codes (w, scales, biases), each head of q and "
        "k RMS-normalised by head_norms (q's, k's) where given, then RoPE on q and k -> (q, k, "
        "v), each (B, H, 1, D).");
  m.def("decode_tail", &qfserve::decode_tail, nb::arg("a"), nb::arg("x"), nb::arg("o"),
        nb::arg("norm"), nb::arg("eps"), nb::arg("gate"), nb::arg("up"), nb::arg("down"),
        nb::kw_only(), nb::arg("post_attention") = nb::none(),
        nb::arg("post_feedforward") = nb::none(), nb::arg("activation") = "swiglu",
        nb::arg("stream") = nb::none(),
        "The rest of a decode step's block in one op: h = x + post_attention(o(a)), then "
        "h + post_feedforward(down(act(gate(n), up(n)))) with n = rms_norm(h, norm, eps), act "
        "swiglu or gelu_approx, and each post norm skipped where not given.");
  m.def(
      "activation_bits",
      [](std::optional<int> bits) {
        if (bits) qfserve::detail::set_integer_activations(*bits);
        return qfserve::detail::integer_activations();
      },
      nb::arg("bits") = nb::none(),
      "The bits decode steps' products round x to, per block of 32 (AVX-512 VNNI): 32 (the "
      "default), 16, 8, or 0 for float32; set first where bits is given. 0 where the CPU "
      "lacks VNNI.");
  m.attr("integer_activations") = qfserve::detail::integer_available();
  m.def("threads", [] { return qfserve::pool().threads(); }, "Threads of the kernels' pool.");
#if defined(__AVX512F__)
  m.attr("simd") = "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
  m.attr("simd") = "avx2";
#else
  m.attr("simd") = "none";
#endif
}
