"""Generated training documents: every answer is recoverable from earlier text, exactly.

The checks parse the documents independently of the generators: an answer must equal the
value an earlier line states for the same name, and the tokens marked as answers must decode
to the answer text with the tokenizer the bundled model was trained with.
"""

from __future__ import annotations

import random
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer

from training.data import encode_doc
from training.synthetic import Filler, kv_doc, passkey_doc, recall_doc

CODE = ["def f(x):", "    return x + 1", "class A:", "    pass", "import os"]
FILLER = Filler(CODE)
TOKENIZER = Path(__file__).resolve().parents[2] / "training/checkpoints/qfserve-tiny/tokenizer.json"


def _line_of(text: str, start: int) -> tuple[str, int]:
    """The line holding character ``start`` and the offset of ``start`` inside it."""
    begin = text.rfind("\n", 0, start) + 1
    end = text.find("\n", start)
    return text[begin : end if end >= 0 else len(text)], start - begin


@pytest.mark.parametrize("n_tokens", [64, 256, 1024, 2048])
def test_recall_answers_equal_the_earlier_statement_with_the_same_words(n_tokens):
    for seed in range(60):
        doc = recall_doc(random.Random(seed), n_tokens, FILLER)
        assert doc.answers, seed
        questions = doc.text.index("Questions.\n")
        statements = doc.text[:questions]
        for start, end in doc.answers:
            assert start > questions
            line, at = _line_of(doc.text, start)
            prefix, answer = line[:at], doc.text[start:end]
            assert answer.isdigit() and line == f"{prefix}{answer}."
            stated = re.findall(rf"^{re.escape(prefix)}(\d+)\.$", statements, flags=re.M)
            assert stated == [answer], (seed, prefix)  # stated once, with this very value


def test_recall_asks_every_name_and_is_deterministic():
    for seed in range(40):
        a = recall_doc(random.Random(seed), 512, FILLER)
        b = recall_doc(random.Random(seed), 512, FILLER)
        assert a == b
        statements = a.text[: a.text.index("Questions.\n")]
        stated = set(re.findall(r"^(.*?)\d+\.$", statements, flags=re.M))
        asked = {_line_of(a.text, s)[0][: _line_of(a.text, s)[1]] for s, _ in a.answers}
        assert asked == stated


def test_passkey_and_kv_answers_match_what_was_stated():
    for seed in range(40):
        doc = passkey_doc(random.Random(seed), 400, FILLER)
        ((start, end),) = doc.answers
        stated = re.search(r"The pass key is (\d+)\. Remember it\.", doc.text)
        assert stated is not None and stated[1] == doc.text[start:end]
        doc = kv_doc(random.Random(seed), 300, FILLER)
        listed = dict(re.findall(r'^(?:    ")?([a-z]+)"?: (\d+),?$', doc.text, flags=re.M))
        assert listed
        for start, end in doc.answers:
            line, at = _line_of(doc.text, start)
            query = re.fullmatch(
                r'The code of ([a-z]+) is |assert codes\["([a-z]+)"\] == ', line[:at]
            )
            assert query is not None, line
            assert listed[query[1] or query[2]] == doc.text[start:end], seed


def test_answer_tokens_decode_to_the_answer_text():
    corpus = SimpleNamespace(tokenizer=Tokenizer.from_file(str(TOKENIZER)))
    for seed in range(20):
        doc = recall_doc(random.Random(seed), 256, FILLER)
        ids, targets = encode_doc(corpus, doc)
        # Digits are single tokens, so the marked tokens are exactly the answers' digits.
        expected = "".join(doc.text[s:e] for s, e in doc.answers)
        assert corpus.tokenizer.decode([ids[t] for t in targets]) == expected
