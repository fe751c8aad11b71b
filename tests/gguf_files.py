"""Small GGUF files for tests, written with llama.cpp's own ``gguf`` writer.

:func:`write_tiny_gguf` stores a tiny random Llama (or Qwen2) the way llama.cpp's converter
does: tensors under GGUF names, Llama Q/K rows permuted for interleaved RoPE, some tensors
quantized to Q8_0, a byte-level BPE vocabulary with merges and control tokens, and a chat
template. It also returns the Hugging Face-order float32 weights the file decodes to (each
quantized tensor dequantized by the ``gguf`` package), as the independent reference.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize
from mlx.utils import tree_flatten

from tests.tiny import CHAT_TEMPLATE, SPECIAL_TOKENS, TINY_CONFIG, _train_tokenizer, make_tiny_model

# HF name pieces -> GGUF name pieces (written independently of qfserve.engine.models.gguf.reader's table).
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
Q8_0 = GGMLQuantizationType.Q8_0


def gguf_name(hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        return f"blk.{layer}.{_LAYER[module]}.{kind}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[hf_name]


def llama_cpp_permute(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's ``convert_hf_to_gguf`` Q/K permutation (rotate-half -> interleaved pairs)."""
    shape = rows.shape
    return (
        rows.reshape(n_heads, 2, shape[0] // n_heads // 2, *shape[1:]).swapaxes(1, 2).reshape(shape)
    )


def llama_cpp_rope_factors(factor: float, cfg: dict[str, Any]) -> np.ndarray:
    """What llama.cpp's converter writes as ``rope_freqs`` for Llama 3.1 scaling (its loop,
    with Llama 3.1's low / high frequency factors 1 and 4 over an 8,192-token original)."""
    dim, base, old = cfg["head_dim"], cfg["rope_theta"], 8192
    out = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old / 4.0:
            out.append(1.0)
        elif wavelen > old / 1.0:
            out.append(factor)
        else:
            smooth = (old / wavelen - 1.0) / (4.0 - 1.0)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def write_tiny_gguf(
    path: Path,
    *,
    arch: str = "llama",
    quantized: tuple[str, ...] = ("attn_q", "attn_v", "ffn_up", "token_embd"),
    qtype: GGMLQuantizationType = Q8_0,
    tokenizer_model: str = "gpt2",
    pre: str = "gpt2",
    seed: int = 0,
    llama3_factor: float | None = None,
    extra_kv: dict[str, int] | None = None,
    **config: Any,
) -> dict[str, np.ndarray]:
    """Write a tiny model as GGUF; return its decoded weights under HF names, HF row order.

    Args:
        arch: ``general.architecture`` (``"qwen2"`` adds q/k/v biases and skips the permutation).
        quantized: GGUF name stems stored as ``qtype``; the rest are F32.
        tokenizer_model, pre: ``tokenizer.ggml.model`` / ``tokenizer.ggml.pre``.
        llama3_factor: Add Llama 3.1-style RoPE scaling with this factor, stored as
            llama.cpp's converter stores it: a ``rope_freqs`` tensor of per-pair factors.
        extra_kv: More uint32 metadata fields.
        config: Overrides of :data:`tests.tiny.TINY_CONFIG`.
    """
    cfg = {**TINY_CONFIG, **config}
    tok = _train_tokenizer(cfg["vocab_size"])
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    cfg["vocab_size"] = len(tokens)
    merges = [" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]]
    model = make_tiny_model(seed, **cfg)
    weights = {k: np.array(v) for k, v in tree_flatten(model.parameters())}
    if arch == "qwen2":
        rng = np.random.default_rng(seed)
        for i in range(cfg["num_hidden_layers"]):
            for name in ("q_proj", "k_proj", "v_proj"):
                rows = weights[f"model.layers.{i}.self_attn.{name}.weight"].shape[0]
                weights[f"model.layers.{i}.self_attn.{name}.bias"] = rng.normal(
                    0, 0.1, rows
                ).astype(np.float32)

    writer = hparams_writer(path, arch, cfg, cfg["head_dim"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|bos|>"])
    writer.add_eos_token_id(vocab["<|end|>"])
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)
    for key, value in (extra_kv or {}).items():
        writer.add_uint32(key, value)
    if llama3_factor is not None:
        writer.add_tensor("rope_freqs.weight", llama_cpp_rope_factors(llama3_factor, cfg))

    decoded: dict[str, np.ndarray] = {}
    for hf_name, value in weights.items():
        name = gguf_name(hf_name)
        stem = name.split(".")[-2]
        if arch == "llama" and stem in ("attn_q", "attn_k"):
            heads = cfg["num_attention_heads"] if stem == "attn_q" else cfg["num_key_value_heads"]
            stored = llama_cpp_permute(value, heads)
        else:
            stored = value
        if stem in quantized and value.ndim == 2:
            decoded[hf_name] = add_matrix(writer, name, stored, value, qtype, seed=len(decoded))
        else:
            writer.add_tensor(name, stored.astype(np.float32))
            decoded[hf_name] = value.astype(np.float32)
    _finish(writer)
    return decoded


def hparams_writer(path: Path, arch: str, cfg: dict[str, Any], head_dim: int) -> GGUFWriter:
    """A writer of ``arch`` holding the hyperparameters every family's file has, from the
    mlx-lm config ``cfg``. Named so that llama.cpp patches no vocabulary by model name."""
    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny test model")
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg.get("max_position_embeddings", 2048))
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    return writer


def add_matrix(
    writer: GGUFWriter,
    name: str,
    stored: np.ndarray,
    value: np.ndarray,
    qtype: GGMLQuantizationType,
    seed: int,
) -> np.ndarray:
    """Write ``stored`` (``value``'s rows as the file keeps them) quantized to ``qtype``;
    return what ``value`` decodes to. K-quants, which ``gguf`` cannot quantize, are random
    blocks of the type instead."""
    if qtype.name in HALVES:
        data = random_blocks(qtype.name, *value.shape, seed=seed)
        writer.add_tensor(name, data, raw_dtype=qtype)
        return np.asarray(dequantize(data, qtype)).reshape(value.shape)
    writer.add_tensor(name, quantize(stored, qtype), raw_dtype=qtype)
    # Quantization groups run along rows, so it commutes with the row permutation.
    return np.asarray(dequantize(quantize(value, qtype), qtype))


# Where K-quant blocks keep their float16 fields (byte offsets), for random blocks.
HALVES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82)}


def random_blocks(
    type_name: str,
    rows: int,
    k: int,
    seed: int,
    *,
    halves: tuple[int, ...] | None = None,
    extreme: bool = False,
) -> np.ndarray:
    """Random bytes as a tensor of ``type_name`` (rows, k), its float16 fields finite (small,
    or tiny and huge ones where ``extreme``); ``halves``: their offsets (default
    :data:`HALVES`)."""
    qtype = GGMLQuantizationType[type_name]
    block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * k // block, size), dtype=np.uint8)
    for offset in HALVES[type_name] if halves is None else halves:
        if extreme:
            values = rng.choice(np.array([6e-8, 1e-5, 0.5, 3e3, 6e4, -6e4], np.float16), len(raw))
        else:
            values = (rng.standard_normal(len(raw)) * 0.002).astype(np.float16)
        raw[:, offset : offset + 2] = values.view(np.uint8).reshape(-1, 2)
    return raw.reshape(rows, k // block * size)


def write_other_architecture(path: Path, arch: str) -> Path:
    """A minimal valid GGUF file of another architecture (one tensor)."""
    writer = GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    _finish(writer)
    return path


def write_with_q8_1(path: Path) -> Path:
    """A tiny Llama whose ``blk.0.attn_k.weight`` is stored as Q8_1, a type llama.cpp uses
    only for intermediate results and that neither MLX nor the ``gguf`` package decodes."""
    source = path.with_name(path.stem + "-source.gguf")
    write_tiny_gguf(source)
    reader = GGUFReader(source)
    writer = GGUFWriter(str(path), "llama")
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), kind, sub_type=sub)
    for tensor in reader.tensors:
        if tensor.name == "blk.0.attn_k.weight":
            rows, cols = (int(d) for d in reversed(tensor.shape))
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType.Q8_1]
            raw = np.zeros((rows, cols // block * size), np.uint8)
            writer.add_tensor(tensor.name, raw, raw_dtype=GGMLQuantizationType.Q8_1)
        else:
            writer.add_tensor(tensor.name, np.asarray(tensor.data), raw_dtype=tensor.tensor_type)
    _finish(writer)
    return path


def _finish(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def load_converted_tiny(
    scratch: Path, quantized: tuple[str, ...], qtype: GGMLQuantizationType
) -> Any:
    """A tiny GGUF with ``quantized`` stored as ``qtype``, converted in a scratch cache under
    ``scratch`` and loaded as the server loads it (the native kernel itself is built once,
    into qfserve's own cache)."""
    import pytest

    from qfserve.engine.models.gguf.convert import converted_folder
    from qfserve.engine.models.loading import load_model

    write_tiny_gguf(scratch / "tiny.gguf", quantized=quantized, qtype=qtype)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QFSERVE_CACHE", str(scratch / "cache"))
        folder = converted_folder(scratch / "tiny.gguf")
    return load_model(str(folder))
