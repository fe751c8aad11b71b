"""Calibration text: user files or, offline by default, the Python standard library's sources.

The default text must exist on every machine without a download, so it is the top-level
``*.py`` files of the running Python's standard library (``sysconfig.get_paths()["stdlib"]``),
sorted by name, then shuffled with the seed (so a fixed Python version and seed always give
the same text). Each document contributes at most one sequence's worth of tokens, its
beginning, so 20 sequences come from at least 20 files. It is code and English prose in comments and docstrings: not the paper's
Pile sample, but a query direction is a property of the head more than of the text, and users
who care can pass their own files with ``--text``.
"""

from __future__ import annotations

import platform
import sysconfig
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

DEFAULT_SEQUENCES = 20
DEFAULT_TOKENS = 2048
_MAX_CHARS_PER_TOKEN = 16


def stdlib_files(seed: int = 0) -> list[Path]:
    """The default calibration documents: stdlib ``*.py`` files, sorted then seed-shuffled."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no Python sources found in the standard library at {root}")
    order = np.random.default_rng(seed).permutation(len(files))
    return [files[i] for i in order]


def describe_stdlib(seed: int, used: int) -> str:
    """The artifact's ``text`` description for the default text."""
    return (
        f"Python {platform.python_version()} standard library: top-level *.py files "
        f"(sysconfig 'stdlib'), sorted by name, shuffled with seed {seed}; the beginnings of the "
        f"first {used}"
    )


def describe_files(files: Sequence[str | Path], used: int) -> str:
    """The artifact's ``text`` description for user files."""
    names = [Path(f).name for f in files[:used]]
    shown = ", ".join(names[:8]) + (f", ... ({len(names)} files)" if len(names) > 8 else "")
    return f"user text files: {shown}"


def read_documents(files: Iterable[str | Path]) -> Iterator[str]:
    """Yield each file's text (UTF-8, undecodable bytes replaced)."""
    for f in files:
        yield Path(f).read_text(encoding="utf-8", errors="replace")


def make_sequences(
    tokenizer: Any,
    documents: Iterable[str],
    *,
    n_sequences: int = DEFAULT_SEQUENCES,
    tokens: int = DEFAULT_TOKENS,
) -> tuple[list[list[int]], int]:
    """Cut documents into calibration sequences of ``tokens`` tokens each.

    Each document first contributes at most one sequence's worth of tokens (its beginning),
    so the sequences span many documents rather than the first few long ones; short
    documents are concatenated. When every document has given its beginning and sequences
    are still missing, the rest of the long documents is cut up too (one long file gives as
    many sequences as it holds). Each sequence starts the way the tokenizer starts a prompt
    (its BOS, if it adds one). Only as many documents as needed are read. If the text runs
    out, the last sequence may be shorter and fewer sequences are returned.

    Args:
        tokenizer: mlx-lm tokenizer wrapper or any object with a Hugging Face ``encode``.
        documents: Texts, in order.
        n_sequences: Sequences wanted (>= 1). Default: 20.
        tokens: Tokens per sequence, prompt start included (>= 2). Default: 2048.
    Returns:
        The sequences, and how many documents were read.
    Raises:
        ValueError: bad counts, or the documents yield no tokens.
    """
    if n_sequences < 1:
        raise ValueError(f"n_sequences must be >= 1, got {n_sequences}")
    if tokens < 2:
        raise ValueError(f"tokens must be >= 2, got {tokens}")
    prefix = list(tokenizer.encode(""))[: tokens - 1]
    body = tokens - len(prefix)
    sequences: list[list[int]] = []
    stream: list[int] = []
    used = 0
    longer: list[str] = []  # documents with more than their head, for a second pass

    def cut() -> None:
        nonlocal stream
        while len(stream) >= body and len(sequences) < n_sequences:
            sequences.append(prefix + stream[:body])
            stream = stream[body:]

    for doc in documents:
        used += 1
        # Tokenise only the document's head: a token is rarely longer than 16 characters.
        head = doc[: body * _MAX_CHARS_PER_TOKEN] + "\n\n"
        ids = tokenizer.encode(head, add_special_tokens=False, verbose=False)
        stream.extend(ids[:body])
        if len(ids) > body or len(doc) > len(head):
            longer.append(doc)
        cut()
        if len(sequences) == n_sequences:
            break
    for doc in longer if len(sequences) < n_sequences else ():
        ids = tokenizer.encode(doc + "\n\n", add_special_tokens=False, verbose=False)
        stream.extend(ids[body:])
        cut()
        if len(sequences) == n_sequences:
            break
    if len(sequences) < n_sequences and stream:
        sequences.append(prefix + stream)
    if not sequences:
        raise ValueError("the calibration text produced no tokens")
    return sequences, used
