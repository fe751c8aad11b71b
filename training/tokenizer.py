"""Byte-level BPE for qfserve-tiny: single-digit tokens, ChatML special tokens, chat template.

Digits are split into one token each before BPE so the model copies numbers digit by digit.
``save_tokenizer_files`` writes the ``tokenizer.json`` / ``tokenizer_config.json`` pair that
``transformers.AutoTokenizer`` and mlx-lm's ``TokenizerWrapper`` load from a local folder.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<|bos|>"
EOS = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = (BOS, EOS, IM_START, IM_END, PAD)  # ids 0..4
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def train_tokenizer(texts: Iterable[str], *, vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE with single-digit pre-tokenization.

    Args:
        texts: training text, iterated once, in a fixed order for determinism.
        vocab_size: total vocabulary including the special tokens and 256 byte tokens.
    """
    if vocab_size < 512:
        raise ValueError(f"vocab_size must be >= 512, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def load_tokenizer(path: str | Path) -> Tokenizer:
    return Tokenizer.from_file(str(path))


def eos_token_ids(tok: Tokenizer) -> list[int]:
    """Ids that end generation: end of a chat turn and end of a document."""
    return [tok.token_to_id(IM_END), tok.token_to_id(EOS)]


def save_tokenizer_files(tok: Tokenizer, folder: str | Path, *, max_length: int) -> None:
    """Write tokenizer.json and tokenizer_config.json (with the chat template) into ``folder``."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": IM_END,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    special = {"bos_token": BOS, "eos_token": IM_END, "pad_token": PAD}
    (folder / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")
