"""A GGUF file's tokenizer as Hugging Face ``tokenizers`` files, for mlx-lm's tokenizer wrapper.

GGUF stores a byte-level BPE vocabulary (``tokenizer.ggml.model = "gpt2"``) as its tokens,
token types and merges, and names its pre-tokenizer (``tokenizer.ggml.pre``) rather than
storing it; the names map to the pre-tokenizers the original ``tokenizer.json`` files use.
Control tokens (type 3) are special tokens; the chat template is ``tokenizer.chat_template``.
SentencePiece vocabularies (``"llama"``) are built by :mod:`.spm`.
"""

from __future__ import annotations

from typing import Any

from qfserve.engine.models.gguf.reader import GGUFError, GGUFFile
from qfserve.engine.models.gguf.spm import build_spm_tokenizer

# llama.cpp's token types (gguf.TokenType).
CONTROL, USER_DEFINED = 3, 4
# Regexes of the pre-tokenizers that split before the byte-level step (from the models'
# own tokenizer.json files; llama.cpp keeps the same list in llama-vocab.cpp).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZERS = ("gpt2", "smollm", "llama-bpe", "qwen2")
# Other names llama.cpp gives the same pre-tokenizers (llama-vocab.cpp).
PRE_ALIASES = {
    "gpt-2": "gpt2",
    "llama3": "llama-bpe",
    "llama-v3": "llama-bpe",
    "falcon3": "llama-bpe",
    "pixtral": "llama-bpe",
    "deepseek-r1-qwen": "qwen2",
    "megrez": "qwen2",
}
# Tokens that close a turn in common chat templates; generation stops at those the
# template uses, as well as at EOS.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>")


def _pre_tokenizer(name: str) -> tuple[Any, Any]:
    """``(normalizer, pre_tokenizer)`` for a ``tokenizer.ggml.pre`` name."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    if name == "gpt2":
        return None, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if name == "smollm":  # GPT-2's split with every digit on its own
        return None, pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = _LLAMA3_SPLIT if name == "llama-bpe" else _QWEN2_SPLIT
    normalizer = normalizers.NFC() if name == "qwen2" else None
    return normalizer, pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False), byte_level]
    )


def token_id(file: GGUFFile, key: str) -> int | None:
    """Metadata ``tokenizer.ggml.<key>_token_id``, when it names a token of the vocabulary."""
    value = file.metadata.get(f"tokenizer.ggml.{key}_token_id")
    if value is None or not 0 <= int(value) < len(file.vocab["tokens"]):
        return None
    return int(value)


def token_text(file: GGUFFile, key: str) -> str | None:
    """The text of the token :func:`token_id` names."""
    index = token_id(file, key)
    return None if index is None else str(file.vocab["tokens"][index])


def pre_tokenizer_name(file: GGUFFile) -> str:
    """``tokenizer.ggml.pre`` with llama.cpp's aliases resolved (absent: GPT-2's)."""
    pre = str(file.metadata.get("tokenizer.ggml.pre", "gpt2"))
    return PRE_ALIASES.get(pre, pre)


def adds_bos(file: GGUFFile) -> bool:
    """``tokenizer.ggml.add_bos_token``; when absent, llama.cpp's default (SentencePiece
    vocabularies and Llama 3 add it)."""
    value = file.metadata.get("tokenizer.ggml.add_bos_token")
    if value is not None:
        return bool(value)
    return file.metadata.get("tokenizer.ggml.model") == "llama" or (
        pre_tokenizer_name(file) == "llama-bpe"
    )


def build_tokenizer(file: GGUFFile) -> Any:
    """The file's tokenizer as a ``tokenizers.Tokenizer``.

    Raises:
        GGUFError: no vocabulary, a tokenizer model other than ``gpt2`` (byte-level BPE), or
            a pre-tokenizer outside :data:`PRE_TOKENIZERS`.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    meta = file.metadata
    kind = meta.get("tokenizer.ggml.model")
    bos, bos_id = token_text(file, "bos"), token_id(file, "bos")
    bos_pair = (bos, bos_id) if adds_bos(file) and bos is not None and bos_id is not None else None
    if kind == "llama":
        return build_spm_tokenizer(file, bos_pair)
    if kind != "gpt2":
        raise GGUFError(
            file.path,
            f"unsupported tokenizer model {kind!r}; qfserve reads byte-level BPE ('gpt2') and "
            "SentencePiece ('llama')",
        )
    pre = pre_tokenizer_name(file)
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(
            file.path,
            f"unsupported pre-tokenizer {pre!r} (tokenizer.ggml.pre); supported: "
            f"{[*PRE_TOKENIZERS, *PRE_ALIASES]}",
        )
    tokens = [str(t) for t in file.vocab.get("tokens", ())]
    if not tokens or "merges" not in file.vocab:
        raise GGUFError(file.path, "no tokenizer.ggml.tokens / tokenizer.ggml.merges vocabulary")
    # Byte-level symbols never contain a space, so the first one separates the pair.
    merges = [(a, b) for a, _, b in (str(m).partition(" ") for m in file.vocab["merges"])]
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=merges,
        ignore_merges=pre == "llama-bpe",  # Llama 3 takes whole-word vocabulary hits first
    )
    tokenizer = Tokenizer(bpe)
    normalizer, pre_tokenizer = _pre_tokenizer(pre)
    if normalizer is not None:
        tokenizer.normalizer = normalizer
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    types = file.vocab.get("token_type", [1] * len(tokens))
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == CONTROL
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == USER_DEFINED
        ]
    )
    if bos_pair is not None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0",
            pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, bos_id)],
        )
    else:
        tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    return tokenizer


def stop_token_ids(file: GGUFFile) -> list[int]:
    """EOS, the file's end-of-turn token, and the end-of-turn tokens its chat template uses."""
    tokens = file.vocab["tokens"]
    template = str(file.metadata.get("tokenizer.chat_template") or "")
    ids: list[int] = []
    for key in ("eos", "eot", "eom"):
        index = token_id(file, key)
        if index is not None:
            ids.append(index)
    types = file.vocab.get("token_type", [])
    for text in END_OF_TURN:
        if text in template and text in tokens:
            index = tokens.index(text)
            if not types or types[index] == CONTROL:
                ids.append(index)
    return list(dict.fromkeys(ids))


def tokenizer_config(file: GGUFFile, context_length: int) -> dict[str, Any]:
    """``tokenizer_config.json`` for ``transformers``' fast tokenizer."""
    meta = file.metadata
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_text(file, "bos"),
        "eos_token": token_text(file, "eos"),
        "unk_token": token_text(file, "unknown"),
        "pad_token": token_text(file, "padding"),
        "add_bos_token": adds_bos(file),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": context_length,
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = str(template)
    return config
