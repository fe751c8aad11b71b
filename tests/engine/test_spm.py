"""SentencePiece vocabularies from GGUF (``tokenizer.ggml.model = llama``): qfserve's tokenizer
against a direct implementation of llama.cpp's algorithm, and against llama.cpp itself on the
same file where llama-cpp-python is installed (also on Gemma 3 270M's file where cached)."""

from __future__ import annotations

import pytest

from qfserve.engine.models.gguf.reader import open_gguf
from qfserve.engine.models.gguf.tokenizer import build_tokenizer
from qfserve.testing import llama_cpp_python
from tests.gguf_families import SPM_SPECIAL, SPM_USER_DEFINED, spm_vocabulary, write_spm_gguf

CORPUS = [
    "Hello world",
    " Hello  world",
    "  leading spaces",
    "trailing   ",
    "tabs\tand\t\ttabs",
    "newlines\n\nand\n\n\nmore\n",
    "digits 1234567890 3.14159 -42",
    "café naïve über",
    "Unicode 日本語 한국어 🙂👍🏽 Привет мир مرحبا",
    "<start_of_turn>user\nHi<end_of_turn>\n",
    "<b>bold</b> text",
    "mixed   \n  \t whitespace",
    "",
    " ",
    "\n",
    "x\r\ny\rz",
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x**2  # comment",
    "special <s> inside </s> and <unk>",
    "a" * 40,
    "\u200b zero width \u00a0nbsp",
]


def llama_cpp_spm(text: str, add_space_prefix: bool) -> list[int]:
    """llama.cpp's SentencePiece tokenization (llm_tokenizer_spm, llama-vocab.cpp), written
    out directly: special pieces split off longest first, a space prefix per text fragment,
    then the adjacent pair making the best-scoring piece merged (ties: leftmost) until none,
    and characters outside the vocabulary as their bytes."""
    tokens, scores, types = spm_vocabulary()
    index = {t: i for i, t in enumerate(tokens)}
    specials = sorted(SPM_SPECIAL + SPM_USER_DEFINED, key=len, reverse=True)
    fragments: list[str | int] = [text]
    for special in specials:
        out: list[str | int] = []
        for fragment in fragments:
            if not isinstance(fragment, str):
                out.append(fragment)
                continue
            pieces = fragment.split(special)
            for k, piece in enumerate(pieces):
                if piece:
                    out.append(piece)
                if k < len(pieces) - 1:
                    out.append(index[special])
        fragments = out
    ids: list[int] = [1]  # BOS
    previous_special = True
    for fragment in fragments:
        if isinstance(fragment, int):
            ids.append(fragment)
            previous_special = True
            continue
        text = (" " if add_space_prefix and previous_special else "") + fragment
        symbols = list(text.replace(" ", "\u2581"))
        previous_special = False
        while True:
            best = None
            for i in range(len(symbols) - 1):
                j = index.get(symbols[i] + symbols[i + 1])
                if j is not None and types[j] == 1 and (best is None or scores[j] > best[0]):
                    best = (scores[j], i)
            if best is None:
                break
            i = best[1]
            symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
        for symbol in symbols:
            if symbol in index:
                ids.append(index[symbol])
            else:
                ids.extend(index[f"<0x{b:02X}>"] for b in symbol.encode())
    return ids


@pytest.mark.parametrize("prefix", [False, True])
def test_tokens_are_llama_cpps_algorithm_and_decode_round_trips(tmp_path, prefix):
    path = tmp_path / "spm.gguf"
    write_spm_gguf(path, add_space_prefix=prefix)
    tokenizer = build_tokenizer(open_gguf(path))
    for text in CORPUS:
        ids = tokenizer.encode(text).ids
        assert ids == llama_cpp_spm(text, prefix), text
        # With a space prefix, a fragment after a special piece gains one (llama.cpp's too).
        if not prefix or not any(s in text for s in SPM_SPECIAL + SPM_USER_DEFINED):
            assert tokenizer.decode(ids[1:], skip_special_tokens=False) == text


@pytest.mark.parametrize("prefix", [False, True])
def test_tokens_equal_llama_cpps_on_the_same_file(tmp_path, prefix):
    llama_cpp = llama_cpp_python()
    if llama_cpp is None:
        pytest.skip("llama-cpp-python is not installed (bench/reference/llama_cpp_tools.sh)")
    path = tmp_path / "spm.gguf"
    write_spm_gguf(path, add_space_prefix=prefix)
    tokenizer = build_tokenizer(open_gguf(path))
    reference = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in CORPUS:
        theirs = reference.tokenize(text.encode(), add_bos=True, special=True)
        assert tokenizer.encode(text).ids == theirs, text


def test_gemma3_270m_tokens_equal_llama_cpps():
    from qfserve.engine.models.catalog import GEMMA3_270M, cached_gguf

    llama_cpp = llama_cpp_python()
    path = cached_gguf(GEMMA3_270M)
    if llama_cpp is None or path is None:
        pytest.skip("needs llama-cpp-python and Gemma 3 270M's file fetched (qfserve fetch)")
    tokenizer = build_tokenizer(open_gguf(path))
    reference = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    corpus = [*CORPUS, "<start_of_image> <table><tr><td>1</td></tr></table>", "\t\t\tx  \n\n\n"]
    for text in corpus:
        theirs = reference.tokenize(text.encode(), add_bos=True, special=True)
        assert tokenizer.encode(text).ids == theirs, text
        assert tokenizer.decode(theirs[1:], skip_special_tokens=False) == text
