"""Calibration text: sequences of the requested length, prompt start kept, offline default."""

from __future__ import annotations

import pytest

from qfserve.calibrations.corpus import make_sequences, stdlib_files


class _CharTokenizer:
    """One token per character; ``encode`` adds a BOS (0) unless told not to, like HF."""

    def encode(self, text: str, add_special_tokens: bool = True, verbose: bool = True):
        return ([0] if add_special_tokens else []) + [ord(c) for c in text]


def test_each_document_contributes_its_beginning():
    docs = ["abcdefghij", "klmnopqrstuvwxyz", "AB", "CD", "never read"]
    seqs, used = make_sequences(_CharTokenizer(), iter(docs), n_sequences=3, tokens=5)
    # BOS, then at most 4 tokens of each document; short ones are concatenated.
    assert seqs == [[0, *map(ord, "abcd")], [0, *map(ord, "klmn")], [0, *map(ord, "AB\n\n")]]
    assert used == 3


def test_short_text_gives_a_shorter_last_sequence():
    # Beginnings first ("abcd", "g"), then the rest of the long document ("ef"); the text
    # then runs out, so the last sequence is short and fewer than 5 come back.
    seqs, used = make_sequences(_CharTokenizer(), ["abcdef", "g"], n_sequences=5, tokens=5)
    assert seqs == [[0, *map(ord, "abcd")], [0, *map(ord, "g\n\ne")], [0, *map(ord, "f\n\n")]]
    assert used == 2


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_sequences": 0}, "n_sequences must be >= 1, got 0"),
        ({"tokens": 1}, "tokens must be >= 2, got 1"),
    ],
)
def test_bad_counts(kwargs, match):
    with pytest.raises(ValueError, match=match):
        make_sequences(_CharTokenizer(), ["abc"], **kwargs)


def test_no_text():
    with pytest.raises(ValueError, match="no tokens"):
        make_sequences(_CharTokenizer(), [], n_sequences=1, tokens=4)


def test_default_text_is_deterministic_stdlib_sources():
    files = stdlib_files(0)
    assert files == stdlib_files(0) and files != stdlib_files(1)
    assert sorted(files) == sorted(stdlib_files(1))
    assert all(f.suffix == ".py" and f.is_file() for f in files)
    assert any(f.name == "os.py" for f in files)
