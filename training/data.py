"""Training data for qfserve-tiny: the Python standard library plus generated recall documents.

Everything is offline and deterministic. Standard-library files are listed in sorted order and
split into train/eval by a hash of their path; the tokenizer and token streams are cached under
``training/data/``. A training batch is a pure function of ``(seed, step, stage)``, so a resumed
run sees exactly the batches it would have seen had it never stopped.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from training.synthetic import GENERATORS, Doc, Filler, chat_doc, passkey_doc
from training.tokenizer import BOS, EOS, load_tokenizer, train_tokenizer

DATA_DIR = Path(__file__).resolve().parent / "data"
EVAL_BUCKETS = 20  # one file in 20 (by path hash) is held out
SKIP_PARTS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_files() -> list[Path]:
    """Sorted ``.py`` files of the running interpreter's standard library (no site-packages)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not SKIP_PARTS & set(p.relative_to(root).parts))


def split_of(path: Path) -> str:
    root = Path(sysconfig.get_paths()["stdlib"])
    digest = hashlib.sha1(str(path.relative_to(root)).encode()).digest()
    return "eval" if digest[0] % EVAL_BUCKETS == 0 else "train"


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def extract_functions(paths: list[Path], limit: int = 4000) -> list[dict]:
    """Documented, short top-level functions and methods, for the chat samples."""
    root = Path(sysconfig.get_paths()["stdlib"])
    found = []
    for path in paths:
        text = read_text(path)
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError):
            continue
        module = ".".join(path.relative_to(root).with_suffix("").parts)
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            source = ast.get_source_segment(text, node)
            if not doc or not source or len(source) > 1200 or node.name.startswith("_"):
                continue
            found.append(
                {
                    "module": module,
                    "qualname": node.name,
                    "doc": doc.split("\n\n")[0].strip()[:400],
                    "source": source,
                }
            )
    return found[:: max(1, len(found) // limit)][:limit]


@dataclass
class Corpus:
    """Tokenizer, token streams and text pieces shared by the batch builders."""

    tokenizer: Tokenizer
    streams: dict[str, np.ndarray]  # split -> uint16 token stream (bos text eos ...)
    code_lines: dict[str, list[str]]  # split -> non-empty source lines, for code filler
    functions: list[dict]

    @property
    def bos_id(self) -> int:
        return self.tokenizer.token_to_id(BOS)

    @property
    def eos_id(self) -> int:
        return self.tokenizer.token_to_id(EOS)

    def filler(self, split: str) -> Filler:
        return Filler(self.code_lines[split])


def _tokenizer_corpus(train_files: list[Path], functions: list[dict]) -> list[str]:
    rng = random.Random("tokenizer-corpus")
    texts = [read_text(p)[:16000] for p in train_files]
    filler = Filler([line for t in texts[:200] for line in t.splitlines() if line.strip()])
    for i in range(3000):
        gen = list(GENERATORS.values())[i % 3]
        texts.append(gen(rng, 300, filler).text)
        texts.append(chat_doc(rng, 300, filler, functions, BOS).text)
    return texts


def prepare_corpus(
    tokenizer_path: Path | None = None,
    *,
    vocab_size: int = 4096,
    data_dir: Path = DATA_DIR,
    log=print,
) -> Corpus:
    """Build (or load from ``data_dir``) the tokenizer, token streams and text pieces.

    Args:
        tokenizer_path: an existing tokenizer.json to use (e.g. the one a run was started with);
            when None, the cached ``data_dir/tokenizer.json`` is used or trained.
        vocab_size: vocabulary size when a tokenizer has to be trained.
    """
    data_dir.mkdir(parents=True, exist_ok=True)
    files = stdlib_files()
    by_split = {
        "train": [p for p in files if split_of(p) == "train"],
        "eval": [p for p in files if split_of(p) == "eval"],
    }
    functions_path = data_dir / "functions.json"
    if functions_path.exists():
        functions = json.loads(functions_path.read_text())
    else:
        functions = extract_functions(by_split["train"])
        functions_path.write_text(json.dumps(functions))
    if tokenizer_path is None:
        tokenizer_path = data_dir / "tokenizer.json"
        if not tokenizer_path.exists():
            log(f"training tokenizer (vocab {vocab_size}) on {len(by_split['train'])} files")
            tok = train_tokenizer(
                _tokenizer_corpus(by_split["train"], functions), vocab_size=vocab_size
            )
            tok.save(str(tokenizer_path))
    tokenizer = load_tokenizer(tokenizer_path)
    fingerprint = hashlib.sha1(Path(tokenizer_path).read_bytes()).hexdigest()[:12]
    streams, code_lines = {}, {}
    for split, paths in by_split.items():
        texts = [read_text(p) for p in paths]
        code_lines[split] = [line for t in texts for line in t.splitlines() if line.strip()]
        cache = data_dir / f"stdlib-{split}-{fingerprint}.npy"
        if not cache.exists():
            log(f"tokenizing {len(paths)} {split} files")
            encs = tokenizer.encode_batch(texts, add_special_tokens=False)
            bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
            ids = [np.array([bos, *e.ids, eos], dtype=np.uint16) for e in encs]
            np.save(cache, np.concatenate(ids))
        streams[split] = np.load(cache)
    return Corpus(tokenizer, streams, code_lines, functions)


def encode_doc(corpus: Corpus, doc: Doc) -> tuple[list[int], list[int]]:
    """Token ids of ``bos + doc + eos`` and the indices of the tokens inside answer spans."""
    text = doc.text if doc.text.startswith(BOS) else BOS + doc.text
    shift = len(text) - len(doc.text)
    enc = corpus.tokenizer.encode(text + EOS, add_special_tokens=False)
    targets = [
        i
        for i, (s, e) in enumerate(enc.offsets)
        if e > s and any(a + shift <= s and e <= b + shift for a, b in doc.answers)
    ]
    return enc.ids, targets


def make_doc(corpus: Corpus, rng: random.Random, kind: str, n_tokens: int, split: str) -> Doc:
    filler = corpus.filler(split)
    if kind == "chat":
        return chat_doc(rng, n_tokens, filler, corpus.functions, BOS)
    return GENERATORS[kind](rng, n_tokens, filler)


def fit_doc(make, corpus: Corpus, n_tokens: int) -> tuple[list[int], list[int]] | None:
    """Call ``make(budget) -> Doc`` until its encoding fills 90-100% of ``n_tokens``.

    Generators only know a rough tokens-per-word ratio, so the budget is rescaled by the
    measured length; the longest encoding that fits is kept.
    """
    budget, best = n_tokens, None
    for _ in range(5):
        ids, targets = encode_doc(corpus, make(budget))
        if len(ids) <= n_tokens and (best is None or len(ids) > len(best[0])):
            best = (ids, targets)
        if best is not None and len(best[0]) >= 0.9 * n_tokens:
            break
        budget = max(8, int(budget * 0.96 * n_tokens / len(ids)))
    return best


def fitted_doc(
    corpus: Corpus, rng: random.Random, kind: str, n_tokens: int, split: str
) -> tuple[list[int], list[int]] | None:
    """A generated document of at most (and close to) ``n_tokens`` tokens."""
    return fit_doc(lambda budget: make_doc(corpus, rng, kind, budget, split), corpus, n_tokens)


def make_batch(
    corpus: Corpus,
    *,
    seed: int,
    step: int,
    batch_size: int,
    seq_len: int,
    mix: dict[str, float],
    split: str = "train",
) -> np.ndarray:
    """A (B, L + 1) int64 batch, a pure function of its arguments.

    Each row is packed with documents whose kind is drawn from ``mix`` (``stdlib`` or a
    generated kind); generated documents take most of the row so recall spans are long, and
    the rest of a row is filled with standard-library text.
    """
    rng = random.Random(seed * 1_000_003 + step)
    stream = corpus.streams[split]
    kinds, weights = list(mix), list(mix.values())
    rows = np.empty((batch_size, seq_len + 1), dtype=np.int64)
    for r in range(batch_size):
        row: list[int] = []
        while len(row) < seq_len + 1:
            room = seq_len + 1 - len(row)
            kind = rng.choices(kinds, weights)[0]
            doc = None
            if kind != "stdlib" and room >= 48:
                size = room if room < seq_len // 2 else rng.randint(seq_len // 2, room)
                doc = fitted_doc(corpus, rng, kind, size, split)
            if doc is None:
                start = rng.randrange(len(stream) - room)
                doc = (stream[start : start + room].tolist(), [])
            row += doc[0][:room]
        rows[r] = row
    return rows


def passkey_eval_set(
    corpus: Corpus, length: int, n: int, *, filler_kind: str = "classic", digits: int = 5
) -> list[tuple[list[int], list[int]]]:
    """Held-out pass-key documents of about ``length`` tokens (eval seeds, eval-split filler)."""
    docs = []
    filler = corpus.filler("eval")
    for i in range(n):
        rng = random.Random(f"eval-passkey-{filler_kind}-{length}-{i}")
        docs.append(
            fit_doc(
                lambda budget, rng=rng: passkey_doc(
                    rng, budget, filler, digits=digits, filler_kind=filler_kind
                ),
                corpus,
                length,
            )
        )
    return docs


def recall_eval_set(
    corpus: Corpus, kind: str, length: int, n: int
) -> list[tuple[list[int], list[int]]]:
    """Held-out generated documents of a kind (``kv``, ``fact``, ``passkey``) with answer indices."""
    out = []
    for i in range(n):
        rng = random.Random(f"eval-{kind}-{length}-{i}")
        doc = fitted_doc(corpus, rng, kind, length, "eval")
        if doc is not None:
            out.append(doc)
    return out
