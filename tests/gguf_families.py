"""Tiny random GGUF files of the families beside Llama (Gemma 3, Qwen3, Phi-3), written as
llama.cpp's converter writes them, and the mlx-lm model their weights decode to.

Each file is built from a random mlx-lm model of the family: its tensors under GGUF names
(this module's own table, written from llama.cpp's ``convert_hf_to_gguf.py`` and
``gguf/constants.py``, independently of qfserve's), Gemma's norms stored as ``1 + w``, some
matrices quantized; a byte-level BPE vocabulary (from :mod:`tests.tiny`). The returned
reference is the same mlx-lm model with each quantized matrix replaced by what the ``gguf``
package decodes it to.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from gguf import GGMLQuantizationType
from mlx.utils import tree_flatten

from tests.gguf_files import _finish, add_matrix, hparams_writer
from tests.tiny import SPECIAL_TOKENS, _train_tokenizer

# Per family: (GGUF architecture, mlx-lm config overrides).
FAMILIES: dict[str, dict[str, Any]] = {
    "gemma3": {
        "model_type": "gemma3_text",
        "hidden_size": 64,
        "num_hidden_layers": 6,  # one global layer after five sliding ones, as llama.cpp assumes
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 32,
        "query_pre_attn_scalar": 32,
        "sliding_window": 8,  # shorter than the test prompt: the window matters
        "rope_theta": 1_000_000.0,
        "rope_local_base_freq": 10_000.0,
        "rms_norm_eps": 1e-6,
    },
    "qwen3": {
        "model_type": "qwen3",
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "intermediate_size": 128,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,  # not hidden / heads: the file's key_length must be read
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
    },
    "phi3": {
        "model_type": "phi3",
        "hidden_size": 128,
        "num_hidden_layers": 2,
        "intermediate_size": 256,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "rope_theta": 10_000.0,
        "rms_norm_eps": 1e-5,
    },
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.qkv_proj": "attn_qkv",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.gate_up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GEMMA_NORMS = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
Q8_0 = GGMLQuantizationType.Q8_0


def gguf_name(arch: str, hf_name: str) -> str:
    if hf_name.startswith("model.layers."):
        _, _, layer, rest = hf_name.split(".", 3)
        module, kind = rest.rsplit(".", 1)
        table = {**_LAYER, **(_GEMMA_NORMS if arch == "gemma3" else {})}
        table.setdefault("post_attention_layernorm", "ffn_norm")
        return f"blk.{layer}.{table[module]}.{kind}"
    return {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }[hf_name]


def make_family_model(arch: str, vocab_size: int, *, tied: bool, seed: int) -> nn.Module:
    """A random float32 mlx-lm model of the family (norm weights random too)."""
    cfg = {**FAMILIES[arch], "vocab_size": vocab_size, "tie_word_embeddings": tied}
    cfg.setdefault("max_position_embeddings", 2048)
    module = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    model = module.Model(module.ModelArgs.from_dict(cfg))
    if not tied and arch == "gemma3":
        model.tie_word_embeddings = False  # mlx-lm's Gemma decides from the weights it loads
    mx.random.seed(seed)
    params = [(k, mx.random.normal(v.shape) * 0.08) for k, v in tree_flatten(model.parameters())]
    if tied and arch == "gemma3":
        params = [(k, v) for k, v in params if not k.startswith("lm_head")]
        model.pop("lm_head")
        model.tie_word_embeddings = True
    model.load_weights(params, strict=True)
    mx.eval(model.parameters())
    return model


def write_family_gguf(
    path: Path,
    arch: str,
    *,
    tied: bool = True,
    quantized: tuple[str, ...] = ("attn_q", "attn_qkv", "ffn_down", "token_embd", "output"),
    qtype: GGMLQuantizationType = Q8_0,
    seed: int = 0,
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Write a tiny model of ``arch`` as GGUF; return its decoded weights (mlx-lm names) and
    the mlx-lm config they load into."""
    tok = _train_tokenizer(512)
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    model = make_family_model(arch, len(tokens), tied=tied, seed=seed)
    cfg = {**FAMILIES[arch], "vocab_size": len(tokens), "tie_word_embeddings": tied}
    head_dim = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])

    writer = hparams_writer(path, arch, cfg, head_dim)
    if arch == "phi3":
        writer.add_rope_dimension_count(head_dim)
    if arch == "gemma3":
        writer.add_sliding_window(cfg["sliding_window"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")  # llama.cpp's name for it
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges([" ".join(m) for m in json.loads(tok.to_str())["model"]["merges"]])
    writer.add_bos_token_id(vocab["<|bos|>"])
    writer.add_eos_token_id(vocab["<|end|>"])

    decoded: dict[str, np.ndarray] = {}
    for hf_name, value in ((k, np.array(v)) for k, v in tree_flatten(model.parameters())):
        name = gguf_name(arch, hf_name)
        stem = name.split(".")[-2]
        if stem in quantized and value.ndim == 2:
            decoded[hf_name] = add_matrix(writer, name, value, value, qtype, seed=len(decoded))
        else:
            stored = value + 1 if arch == "gemma3" and name.endswith("norm.weight") else value
            writer.add_tensor(name, stored.astype(np.float32))
            decoded[hf_name] = value.astype(np.float32)
    _finish(writer)
    return decoded, cfg


def reference_model(arch: str, decoded: dict[str, np.ndarray], tied: bool) -> nn.Module:
    """The family's mlx-lm model holding ``decoded``."""
    vocab = decoded["model.embed_tokens.weight"].shape[0]
    model = make_family_model(arch, vocab, tied=tied, seed=0)
    model.load_weights([(k, mx.array(v)) for k, v in decoded.items()], strict=True)
    return model


SPM_SPECIAL = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>"]
SPM_USER_DEFINED = ["  ", "   ", "\n\n", "<b>", "</b>"]
SPM_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.\n"
    "def f(x):\n    return x + 1  # one\n0123456789 key value pass café naïve über\n"
) * 30


def spm_vocabulary() -> tuple[list[str], list[float], list[int]]:
    """A small SentencePiece-style BPE vocabulary: control, byte, user-defined and normal
    pieces (``▁`` for spaces), each normal piece scored minus its merge rank, as
    SentencePiece's BPE trainer scores them."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=420, show_progress=False)
    tok.train_from_iterator([SPM_CORPUS], trainer=trainer)
    learned = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = [*SPM_SPECIAL, *(f"<0x{b:02X}>" for b in range(256)), *SPM_USER_DEFINED, *learned]
    types = [2, 3, 3, 3, 3] + [6] * 256 + [4] * len(SPM_USER_DEFINED) + [1] * len(learned)
    scores = [0.0] * (len(tokens) - len(learned)) + [-float(i) for i in range(len(learned))]
    return tokens, scores, types


def write_spm_gguf(path: Path, *, add_space_prefix: bool, seed: int = 0) -> int:
    """A tiny float32 Llama with :func:`spm_vocabulary` (``tokenizer.ggml.model = llama``);
    returns the vocabulary size."""
    from tests.gguf_files import gguf_name as llama_name
    from tests.gguf_files import llama_cpp_permute
    from tests.tiny import TINY_CONFIG, make_tiny_model

    tokens, scores, types = spm_vocabulary()
    cfg = {**TINY_CONFIG, "vocab_size": len(tokens)}
    model = make_tiny_model(seed, vocab_size=len(tokens))
    writer = hparams_writer(path, "llama", cfg, cfg["head_dim"])
    writer.add_rope_dimension_count(cfg["head_dim"])
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_add_space_prefix(add_space_prefix)
    for hf_name, value in ((k, np.array(v)) for k, v in tree_flatten(model.parameters())):
        name = llama_name(hf_name)
        stem = name.split(".")[-2]
        if stem in ("attn_q", "attn_k"):
            heads = cfg["num_attention_heads" if stem == "attn_q" else "num_key_value_heads"]
            value = llama_cpp_permute(value, heads)
        writer.add_tensor(name, value.astype(np.float32))
    _finish(writer)
    return len(tokens)
