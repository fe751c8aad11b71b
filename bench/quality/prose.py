"""English prose every machine has offline: the Python standard library's docstrings.

Module, class and function docstrings of the top-level ``*.py`` files are split into
paragraphs; a paragraph is kept when it reads as prose (at least 120 characters, mostly
letters and spaces, ends a sentence, no doctest or table). About a megabyte of text, the
same on every machine with the same Python.
"""

from __future__ import annotations

import ast
import sysconfig
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

MIN_CHARS = 120


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
