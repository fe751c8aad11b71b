"""The text the studies read: held-out evaluation data, English prose, and prompts.

Held-out data is the training package's evaluation split and seeds; prose is the standard
library's docstring paragraphs; the speed studies' prompts are the first tokens of a few
standard-library sources. All of it is offline and fixed for a Python version.
"""

from __future__ import annotations

import ast
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from training.data import (
    Corpus,
    passkey_eval_set,
    read_text,
    recall_eval_set,
    split_of,
    stdlib_files,
)
from training.tokenizer import BOS, EOS

MIN_CHARS = 120


def fast_tokenizer(tokenizer: Any) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` behind an mlx-lm tokenizer wrapper."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)
    backend = getattr(hf, "backend_tokenizer", hf)
    if not isinstance(backend, Tokenizer):
        raise ValueError(f"need a fast (tokenizers) tokenizer, got {type(backend).__name__}")
    return backend


@lru_cache(maxsize=1)
def _all_files() -> tuple[Path, ...]:
    return tuple(stdlib_files())


@lru_cache(maxsize=2)
def split_files(split: str) -> tuple[Path, ...]:
    """Standard-library files of one split (``train`` or ``eval``), sorted."""
    return tuple(p for p in _all_files() if split_of(p) == split)


def heldout_corpus(tokenizer: Any) -> Corpus:
    """See :func:`_heldout_corpus` (memoised on the tokenizer's definition)."""
    tok = fast_tokenizer(tokenizer)
    return _heldout_corpus(tok.to_str())


@lru_cache(maxsize=2)
def _heldout_corpus(tokenizer_json: str) -> Corpus:
    """A :class:`training.data.Corpus` holding only the evaluation split.

    ``streams["eval"]`` is every held-out file as ``bos text eos`` (the training stream's
    layout); ``code_lines["eval"]`` feeds the generators' code filler.
    """
    tok = Tokenizer.from_str(tokenizer_json)
    texts = [read_text(p) for p in split_files("eval")]
    bos, eos = tok.token_to_id(BOS), tok.token_to_id(EOS)
    encs = tok.encode_batch(texts, add_special_tokens=False)
    ids = [
        np.array([*([bos] if bos is not None else []), *e.ids, *([eos] if eos is not None else [])])
        for e in encs
    ]
    lines = [line for t in texts for line in t.splitlines() if line.strip()]
    return Corpus(tok, {"eval": np.concatenate(ids).astype(np.int64)}, {"eval": lines}, [])


def stdlib_windows(corpus: Corpus, length: int, n: int) -> np.ndarray:
    """``(n, length)`` windows of the held-out stream, evenly spaced (as training.evaluate)."""
    stream = corpus.streams["eval"]
    if len(stream) < length + 1:
        raise ValueError(f"length must be <= {len(stream) - 1} held-out tokens, got {length}")
    starts = np.linspace(0, len(stream) - length - 1, n).astype(int)
    return np.stack([stream[s : s + length] for s in starts])


def recall_windows(corpus: Corpus, length: int, n: int) -> np.ndarray:
    """``(n', length')`` held-out generated documents (kv, fact, pass-key in turn).

    The generators fill 90-100% of ``length``; documents are cut to the shortest so they
    stack into one batch (``length' >= 0.9 * length``).
    """
    kinds = ("kv", "fact", "passkey")
    docs: list[list[int]] = []
    for i, kind in enumerate(kinds):
        count = n // len(kinds) + (i < n % len(kinds))
        if count:
            docs += [ids for ids, _ in recall_eval_set(corpus, kind, length, count)]
    if not docs:
        raise ValueError(f"no held-out generated documents of length {length}")
    cut = min(len(d) for d in docs)
    return np.stack([np.asarray(d[:cut], dtype=np.int64) for d in docs])


def needle_depth(text: str, key: str) -> float:
    """Where the pass key is first stated, as a fraction of the prompt's characters."""
    pos = text.find(key)
    return pos / len(text) if pos >= 0 and text else float("nan")


def passkey_docs(
    corpus: Corpus, length: int, per_bin: int, bins: int = 3, *, filler_kind: str = "classic"
) -> list[dict[str, Any]]:
    """Held-out pass-key documents with the needle spread over ``bins`` depth bins.

    The generator draws the depth at random; we draw candidates from the evaluation seeds in
    order and keep the first ``per_bin`` of each bin, so every bin is equally represented.

    Returns:
        Dicts with ``prompt`` (token ids ending before the key), ``key`` (its text),
        ``answer`` (token ids of " " + key), ``key_tokens``, ``depth`` (0..1) and ``bin``.
    """
    chosen: dict[int, list[dict[str, Any]]] = {b: [] for b in range(bins)}
    n_candidates = per_bin * bins * 4
    docs = passkey_eval_set(corpus, length, n_candidates, filler_kind=filler_kind)
    for doc in docs:
        if doc is None:
            continue
        ids, targets = doc
        # The prompt ends at "...The pass key is"; the model writes " 12345" (as evaluate).
        prompt = ids[: targets[0] - 1]
        key = corpus.tokenizer.decode([ids[t] for t in targets])
        depth = needle_depth(corpus.tokenizer.decode(prompt), key)
        if not np.isfinite(depth):
            continue
        b = min(bins - 1, int(depth * bins))
        if len(chosen[b]) < per_bin:
            chosen[b].append(
                {
                    "prompt": prompt,
                    "key": key,
                    "answer": ids[targets[0] - 1 : targets[-1] + 1],
                    "key_tokens": len(targets),
                    "depth": depth,
                    "bin": b,
                }
            )
    return [d for b in range(bins) for d in chosen[b]]


# -- English prose ----------------------------------------------------------------------


def _is_prose(paragraph: str) -> bool:
    if len(paragraph) < MIN_CHARS or not paragraph.endswith((".", "?", "!")):
        return False
    if ">>>" in paragraph or "::" in paragraph or "|" in paragraph or "==" in paragraph:
        return False
    letters = sum(c.isalpha() or c == " " for c in paragraph)
    return letters / len(paragraph) > 0.85


@lru_cache(maxsize=1)
def stdlib_prose() -> tuple[str, ...]:
    """Prose paragraphs of the standard library's docstrings, in file order."""
    out: list[str] = []
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        for node in ast.walk(tree):
            if not isinstance(
                node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
            ):
                continue
            doc = ast.get_docstring(node)
            for block in (doc or "").split("\n\n"):
                paragraph = " ".join(block.split())
                if _is_prose(paragraph):
                    out.append(paragraph)
    return tuple(dict.fromkeys(out))  # docstrings repeat (overloads, aliases): once each


def prose_windows(tokenizer: Any, length: int, n: int) -> np.ndarray:
    """``(n, length)`` token windows of running prose, starting at ``n`` evenly spaced
    paragraphs of :func:`stdlib_prose` (paragraphs joined by blank lines, as in a text)."""
    paragraphs = stdlib_prose()
    starts = np.linspace(0, len(paragraphs) - 1, n, endpoint=False).astype(int)
    windows = []
    for start in starts:
        ids: list[int] = []
        i = int(start)
        while len(ids) < length:
            ids += tokenizer.encode(
                paragraphs[i % len(paragraphs)] + "\n\n", add_special_tokens=False
            )
            i += 1
        windows.append(ids[:length])
    return np.asarray(windows, dtype=np.int64)


# -- the speed studies' prompts --------------------------------------------------------

_TEXT: str | None = None


def corpus_text() -> str:
    """Real text that exists offline and is fixed for a Python version: stdlib sources."""
    global _TEXT
    if _TEXT is None:
        import argparse as a
        import inspect
        import typing as t

        _TEXT = "\n".join(inspect.getsource(m) for m in (a, t, inspect))
    return _TEXT


_IDS: dict[int, list[int]] = {}


def prompt_tokens(run: Any, n: int) -> list[int]:
    """The first ``n`` tokens of :func:`corpus_text` (repeated if it is too short)."""
    tok = run.tokenizer
    if id(tok) not in _IDS:
        # Encoded in pieces: one long call makes transformers warn about the model's length.
        text = corpus_text()
        _IDS[id(tok)] = [
            t
            for i in range(0, len(text), 4000)
            for t in tok.encode(text[i : i + 4000], add_special_tokens=False)
        ]
    ids = _IDS[id(tok)]
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def chat_content(run: Any, n_tokens: int, nonce: str = "") -> str:
    """User content whose chat-templated prompt is about ``n_tokens`` long."""
    tok = run.tokenizer
    overhead = len(
        tok.apply_chat_template([{"role": "user", "content": nonce}], add_generation_prompt=True)
    )
    body = tok.decode(prompt_tokens(run, max(1, n_tokens - overhead)))
    return nonce + body


def eos_ban(run: Any) -> dict[str, float]:
    """``logit_bias`` that bans every end-of-sequence token, so each run makes max_tokens."""
    return {str(t): -100.0 for t in sorted(run.tokenizer.eos_token_ids)}
