"""Tiny random-weight mlx-lm Llama models for tests: in memory or saved as a loadable folder.

Nothing is downloaded: weights are random (seeded) and the tokenizer is a byte-level BPE
trained in a fraction of a second on a built-in text.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models import llama

TINY_CONFIG: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 128,
    "num_hidden_layers": 2,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,  # 2 query heads per KV head
    "head_dim": 32,
    "rms_norm_eps": 1e-5,
    "vocab_size": 512,
    "rope_theta": 10000.0,
    "max_position_embeddings": 2048,
    "tie_word_embeddings": True,
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
_CORPUS = (
    "The quick brown fox jumps over the lazy dog. def f(x): return x + 1\n"
    "Pack my box with five dozen liquor jugs. 0123456789 key value pass "
) * 40


def make_tiny_model(seed: int = 0, **overrides: Any) -> llama.Model:
    """A random-weight float32 mlx-lm Llama (2 layers, 4 query heads, 2 KV heads)."""
    args = llama.ModelArgs.from_dict({**TINY_CONFIG, **overrides})
    mx.random.seed(seed)
    model = llama.Model(args)
    # Larger-than-default init so attention is far from uniform and logits separate.
    params = [
        (k, mx.random.normal(v.shape) * 0.08)
        for k, v in tree_flatten(model.parameters())
        if "norm" not in k
    ]
    model.load_weights(params, strict=False)
    mx.eval(model.parameters())
    return model


def _train_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([_CORPUS], trainer=trainer)
    return tok


TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>You may call these tools: {{ tools | tojson }}<|end|>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}<tool_call>{{ c['function'] | tojson }}</tool_call>"
    "{% endfor %}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_tiny_model(
    path: str | Path,
    seed: int = 0,
    model_id: str = "test/tiny-llama",
    chat_template: str = CHAT_TEMPLATE,
    **overrides: Any,
) -> Path:
    """Write a folder that ``mlx_lm.load`` accepts: config, weights, tokenizer, chat template."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = {**TINY_CONFIG, **overrides, "_name_or_path": model_id}
    tok = _train_tokenizer(config["vocab_size"])
    config["vocab_size"] = max(config["vocab_size"], tok.get_vocab_size())
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<|bos|>",
                "eos_token": "<|end|>",
                "pad_token": "<|end|>",
                "model_max_length": config["max_position_embeddings"],
                "chat_template": chat_template,
            },
            indent=1,
        )
    )
    (path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<|bos|>", "eos_token": "<|end|>", "pad_token": "<|end|>"})
    )
    model = make_tiny_model(seed, **{k: v for k, v in config.items() if k != "_name_or_path"})
    mx.save_safetensors(
        str(path / "model.safetensors"),
        dict(tree_flatten(model.parameters())),
        metadata={"format": "mlx"},
    )
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path
