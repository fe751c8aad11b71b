"""A GGUF SentencePiece vocabulary (``tokenizer.ggml.model = "llama"``) as a ``tokenizers`` BPE.

llama.cpp tokenizes these vocabularies (Llama 2, Mistral, TinyLlama, Gemma) with
SentencePiece's BPE algorithm on the pieces and scores the file stores: spaces become ``▁``
(with one prepended to each text fragment when ``add_space_prefix``), the text is split into
characters, and the adjacent pair whose concatenation is the highest-scoring piece is merged
until none is left; characters outside the vocabulary become their UTF-8 byte tokens
(``<0xNN>``). ``tokenizers``' BPE model computes the same thing given merges ranked by that
score, which is how Hugging Face converts these vocabularies too
(``SentencePieceExtractor``); no maintained library builds a tokenizer from the GGUF fields,
so the merges are derived here. ``sentencepiece`` itself would need a model proto, which GGUF
does not keep.

Control pieces are special tokens and user-defined pieces (Gemma's whitespace runs and HTML
tags) plain added tokens: both are matched in the raw text before the BPE, as llama.cpp
partitions them out.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qfserve.engine.models.gguf.reader import GGUFError, GGUFFile

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
SPACE = "\u2581"  # ▁, SentencePiece's space


def add_space_prefix(file: GGUFFile) -> bool:
    """``tokenizer.ggml.add_space_prefix``; llama.cpp's default when absent is true."""
    return bool(file.metadata.get("tokenizer.ggml.add_space_prefix", True))


def merges(tokens: list[str], scores: np.ndarray, types: list[int]) -> list[tuple[str, str]]:
    """Every split of a normal piece into two pieces of the vocabulary, ranked as llama.cpp
    merges: the higher the merged piece's score, the earlier (ties: the lower id)."""
    index = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, int, str, str]] = []
    for i, (piece, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind != NORMAL or len(piece) < 2:
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            j, k = index.get(left), index.get(right)
            if j is not None and k is not None:
                found.append((-float(scores[i]), i, cut, left, right))
    found.sort()
    return [(left, right) for _, _, _, left, right in found]


def build_spm_tokenizer(file: GGUFFile, bos: tuple[str, int] | None) -> Any:
    """The file's SentencePiece vocabulary as a ``tokenizers.Tokenizer``.

    Args:
        file: From :func:`qfserve.engine.models.gguf.reader.open_gguf`.
        bos: ``(text, id)`` of the BOS token to add in front of every encoding, or ``None``.
    Raises:
        GGUFError: no tokens, or scores missing or of another length.
    """
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, processors

    tokens = [str(t) for t in file.vocab.get("tokens", ())]
    scores = np.asarray(file.vocab.get("scores", ()), dtype=np.float64)
    if not tokens or scores.shape != (len(tokens),):
        raise GGUFError(
            file.path,
            "a SentencePiece vocabulary needs tokenizer.ggml.tokens and tokenizer.ggml.scores "
            f"of one length (got {len(tokens)} tokens, {scores.size} scores)",
        )
    types = [int(t) for t in file.vocab.get("token_type", [NORMAL] * len(tokens))]
    unk = next((t for t, k in zip(tokens, types, strict=True) if k == UNKNOWN), None)
    bpe = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=merges(tokens, scores, types),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tokenizer = Tokenizer(bpe)
    steps: list[Any] = [normalizers.Replace(Regex(" "), SPACE)]
    if add_space_prefix(file):  # per fragment between added tokens, as llama.cpp prefixes
        steps.insert(0, normalizers.Prepend(SPACE))
    tokenizer.normalizer = normalizers.Sequence(steps)
    decode = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix(file):
        decode.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(decode)
    special = {CONTROL, UNKNOWN}
    tokenizer.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k in special
        ]
    )
    tokenizer.add_tokens(
        [
            AddedToken(t, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == USER_DEFINED
        ]
    )
    if bos is not None:
        text, index = bos
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{text}:0 $A:0",
            pair=f"{text}:0 $A:0 {text}:1 $B:1",
            special_tokens=[(text, index)],
        )
    return tokenizer
