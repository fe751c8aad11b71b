"""The text the studies read, offline and fixed for a Python version: the training package's
evaluation split, the standard library's docstring prose (and needles hidden in it), and its
sources as speed prompts."""

from __future__ import annotations

import ast
import inspect
import random
import re
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


@lru_cache(maxsize=2)
def split_files(split: str) -> tuple[Path, ...]:
    """Standard-library files of one split (``train`` or ``eval``), sorted."""
    return tuple(p for p in stdlib_files() if split_of(p) == split)


def heldout_corpus(tokenizer: Any) -> Corpus:
    """A :class:`training.data.Corpus` of the evaluation split only: ``streams["eval"]`` holds
    every held-out file as ``bos text eos`` (as training), ``code_lines["eval"]`` their lines."""
    hf = getattr(tokenizer, "_tokenizer", tokenizer)  # inside mlx-lm's wrapper
    backend = getattr(hf, "backend_tokenizer", hf)
    if not isinstance(backend, Tokenizer):
        raise ValueError(f"need a fast (tokenizers) tokenizer, got {type(backend).__name__}")
    return _heldout_corpus(backend.to_str())


@lru_cache(maxsize=2)
def _heldout_corpus(tokenizer_json: str) -> Corpus:
    tok = Tokenizer.from_str(tokenizer_json)
    texts = [read_text(p) for p in split_files("eval")]
    ends = [[t] if t is not None else [] for t in (tok.token_to_id(BOS), tok.token_to_id(EOS))]
    encs = tok.encode_batch(texts, add_special_tokens=False)
    stream = np.concatenate([np.array([*ends[0], *e.ids, *ends[1]]) for e in encs])
    lines = [line for t in texts for line in t.splitlines() if line.strip()]
    return Corpus(tok, {"eval": stream.astype(np.int64)}, {"eval": lines}, [])


def stdlib_windows(corpus: Corpus, length: int, n: int) -> np.ndarray:
    """``(n, length)`` windows of the held-out stream, evenly spaced (as training.evaluate)."""
    stream = corpus.streams["eval"]
    if len(stream) < length + 1:
        raise ValueError(f"length must be <= {len(stream) - 1} held-out tokens, got {length}")
    starts = np.linspace(0, len(stream) - length - 1, n).astype(int)
    return np.stack([stream[s : s + length] for s in starts])


def recall_windows(corpus: Corpus, length: int, n: int) -> np.ndarray:
    """``(n', length')`` held-out generated documents (kv, fact, pass-key in turn), cut to the
    shortest so they stack (the generators fill 90-100% of ``length``)."""
    kinds = ("kv", "fact", "passkey")
    docs: list[list[int]] = []
    for i, kind in enumerate(kinds):
        if count := n // len(kinds) + (i < n % len(kinds)):
            docs += [ids for ids, _ in recall_eval_set(corpus, kind, length, count)]
    if not docs:
        raise ValueError(f"no held-out generated documents of length {length}")
    cut = min(len(d) for d in docs)
    return np.stack([np.asarray(d[:cut], dtype=np.int64) for d in docs])


def passkey_docs(
    corpus: Corpus, length: int, per_bin: int, bins: int = 3, *, filler_kind: str = "classic"
) -> list[dict[str, Any]]:
    """Held-out pass-key documents, the first ``per_bin`` of the evaluation seeds whose needle
    falls in each of ``bins`` depth bins: dicts of ``prompt`` (ids up to the key), ``key``
    (its text), ``answer`` (ids of " " + key), ``key_tokens``, ``depth`` (0..1) and ``bin``."""
    chosen: dict[int, list[dict[str, Any]]] = {b: [] for b in range(bins)}
    for doc in passkey_eval_set(corpus, length, per_bin * bins * 4, filler_kind=filler_kind):
        if doc is None:
            continue
        ids, targets = doc
        # The prompt ends at "...The pass key is"; the model writes " 12345" (as evaluate).
        prompt = ids[: targets[0] - 1]
        key = corpus.tokenizer.decode([ids[t] for t in targets])
        text = corpus.tokenizer.decode(prompt)
        if not text or (pos := text.find(key)) < 0:
            continue
        depth = pos / len(text)
        b = min(bins - 1, int(depth * bins))
        if len(chosen[b]) < per_bin:
            doc = {"prompt": prompt, "key": key, "answer": ids[targets[0] - 1 : targets[-1] + 1]}
            chosen[b].append({**doc, "key_tokens": len(targets), "depth": depth, "bin": b})
    return [d for b in range(bins) for d in chosen[b]]


# -- English prose ----------------------------------------------------------------------


def _is_prose(paragraph: str) -> bool:
    if len(paragraph) < MIN_CHARS or not paragraph.endswith((".", "?", "!")):
        return False
    if any(mark in paragraph for mark in (">>>", "::", "|", "==")):
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
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                blocks = (ast.get_docstring(node) or "").split("\n\n")
                out += filter(_is_prose, (" ".join(b.split()) for b in blocks))
    return tuple(dict.fromkeys(out))  # docstrings repeat (overloads, aliases): once each


def prose_windows(tokenizer: Any, length: int, n: int) -> np.ndarray:
    """``(n, length)`` token windows of running prose from ``n`` evenly spaced paragraphs of
    :func:`stdlib_prose` on (joined by blank lines, as in a text)."""
    paragraphs = stdlib_prose()
    windows = []
    for start in np.linspace(0, len(paragraphs) - 1, n, endpoint=False).astype(int):
        ids: list[int] = []
        i = int(start)
        while len(ids) < length:
            text = paragraphs[i % len(paragraphs)] + "\n\n"
            ids += tokenizer.encode(text, add_special_tokens=False)
            i += 1
        windows.append(ids[:length])
    return np.asarray(windows, dtype=np.int64)


# -- needles ----------------------------------------------------------------------------

CITIES = (
    "Lisbon",
    "Nairobi",
    "Osaka",
    "Quito",
    "Tallinn",
    "Hanoi",
    "Accra",
    "Perth",
    "Bergen",
    "Cusco",
    "Dakar",
    "Tbilisi",
    "Malmo",
    "Recife",
    "Gdansk",
    "Kyoto",
    "Tunis",
    "Austin",
)
NEEDLE_INTRO = "Read the text below. A special magic number is hidden in it; remember it.\n\n"


def prose_run(tokenizer: Any, rng: random.Random, length: int) -> list[str]:
    """Consecutive :func:`stdlib_prose` paragraphs from a random one on, about
    ``length`` tokens together."""
    paragraphs = stdlib_prose()
    chosen, start = [], rng.randrange(len(paragraphs))
    while len(tokenizer.encode("\n\n".join(chosen))) < length:
        chosen.append(paragraphs[(start + len(chosen)) % len(paragraphs)])
    return chosen


def needle_doc(
    tokenizer: Any, paragraphs: list[str], length: int, depth: float, index: int
) -> dict[str, Any]:
    """A prompt of at most ``length`` tokens (a few percent under, at a sentence end) of
    ``paragraphs`` with the needle, "The special magic number for <city> is <7 digits>.", at
    ``depth`` of the haystack and the question at the end: ``prompt``, ``number``, ``answer``
    (its ids), ``depth`` (where it went) and ``tokens``."""
    rng = random.Random(f"niah-{length}-{depth}-{index}")
    city = rng.choice(CITIES)
    number = str(rng.randrange(1_000_000, 10_000_000))
    needle = f"The special magic number for {city} is {number}."
    question = (
        f"\n\nWhat is the special magic number for {city}? The special magic number for {city} is"
    )
    reserve = len(tokenizer.encode(NEEDLE_INTRO + needle + question)) + 8
    start = rng.randrange(len(paragraphs))

    def build(room: int) -> tuple[list[int], float]:
        chosen: list[str] = []
        sizes: list[int] = []
        while not chosen or sum(sizes) < room:
            chosen.append(paragraphs[(start + len(chosen)) % len(paragraphs)])
            sizes.append(len(tokenizer.encode(chosen[-1] + "\n\n")))
        # Cut the last paragraph at a word so the haystack fits (it still ends a sentence).
        words = chosen[-1].split()
        while sum(sizes) > max(room, 1) and len(words) > 1:
            words = words[: max(1, len(words) * 3 // 4)]
            chosen[-1] = " ".join(words).rstrip(".,;:") + "."
            sizes[-1] = len(tokenizer.encode(chosen[-1] + "\n\n"))
        # The needle goes between paragraphs, at the boundary nearest to `depth` of the tokens.
        cumulative = np.concatenate([[0], np.cumsum(sizes)])
        slot = int(np.argmin(np.abs(cumulative - depth * cumulative[-1])))
        parts = [*chosen[:slot], needle, *chosen[slot:]]
        prompt = tokenizer.encode(NEEDLE_INTRO + "\n\n".join(parts) + question)
        return prompt, float(cumulative[slot] / max(cumulative[-1], 1))

    # Joined paragraphs tokenise differently from their sum: shrink the room by the overshoot
    # until the prompt fits, never past the model's context.
    room = length - reserve
    prompt, where = build(room)
    while len(prompt) > length and room > 1:
        room = max(1, room - (len(prompt) - length + 4))
        prompt, where = build(room)
    if len(prompt) > length:
        raise ValueError(f"length {length} is too short for the needle and question")
    answer = tokenizer.encode(" " + number)[-len(tokenizer.encode(number)) :]
    return {
        "prompt": prompt,
        "number": number,
        "answer": answer,
        "depth": where,
        "tokens": len(prompt),
    }


def first_number(text: str) -> str | None:
    """The first number in ``text``, if any."""
    found = re.search(r"\d+", text)
    return found.group() if found else None


def first_number_is(text: str, key: str) -> bool:
    """Whether the first number in ``text`` is ``key``: how the needle studies score."""
    return first_number(text) == key


# -- the speed studies' prompts --------------------------------------------------------


@lru_cache(maxsize=1)
def corpus_text() -> str:
    """Real text that exists offline and is fixed for a Python version: stdlib sources."""
    import argparse
    import typing

    return "\n".join(inspect.getsource(m) for m in (argparse, typing, inspect))


_IDS: dict[int, list[int]] = {}


def prompt_tokens(run: Any, n: int) -> list[int]:
    """The first ``n`` tokens of :func:`corpus_text` (repeated if it is too short)."""
    tok, text = run.tokenizer, corpus_text()
    if id(tok) not in _IDS:  # in pieces: one long call makes transformers warn about the length
        pieces = (text[i : i + 4000] for i in range(0, len(text), 4000))
        _IDS[id(tok)] = [t for p in pieces for t in tok.encode(p, add_special_tokens=False)]
    ids = _IDS[id(tok)]
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def chat_content(run: Any, n_tokens: int, nonce: str = "") -> str:
    """User content whose chat-templated prompt is about ``n_tokens`` long."""
    message = [{"role": "user", "content": nonce}]
    if getattr(run.tokenizer, "chat_template", None):
        overhead = len(run.tokenizer.apply_chat_template(message, add_generation_prompt=True))
    else:  # a base model: each server wraps the turn in its own fallback (a few tokens)
        overhead = len(run.tokenizer.encode(nonce))
    return nonce + run.tokenizer.decode(prompt_tokens(run, max(1, n_tokens - overhead)))


def eos_ban(run: Any) -> dict[str, float]:
    """``logit_bias`` that bans every end-of-sequence token, so each run makes max_tokens."""
    return {str(t): -100.0 for t in sorted(run.tokenizer.eos_token_ids)}
