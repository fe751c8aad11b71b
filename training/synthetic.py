"""Generated documents that can only be predicted by recalling something far back.

Every generator takes a ``random.Random`` and a rough token budget and returns a ``Doc``:
the text plus the character spans of its *answers* (the tokens that need recall), which
training uses to track retrieval accuracy and evaluation uses to score it. Filler comes
from a ``Filler`` so the same generators serve short and long documents.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

# The classic pass-key filler (Mohtashami & Jaggi, 2023); evaluation uses it verbatim.
CLASSIC_FILLER = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)
CONSONANTS = "bdfgklmnprstvz"
VOWELS = "aeiou"
COLOURS = ("red", "blue", "green", "teal", "amber", "violet", "grey", "orange", "pink", "white")
PETS = ("cat", "dog", "parrot", "horse", "rabbit", "turtle", "goat", "fox", "owl", "frog")
TOKENS_PER_WORD = 1.4  # rough budget for English filler with this tokenizer


@dataclass
class Doc:
    """A generated document: its text and the [start, end) character spans to recall."""

    text: str
    answers: list[tuple[int, int]] = field(default_factory=list)
    kind: str = ""


class Builder:
    """Appends text pieces and records answer spans as character offsets."""

    def __init__(self, kind: str) -> None:
        self.parts: list[str] = []
        self.length = 0
        self.answers: list[tuple[int, int]] = []
        self.kind = kind

    def add(self, text: str, *, answer: bool = False) -> None:
        if answer:
            self.answers.append((self.length, self.length + len(text)))
        self.parts.append(text)
        self.length += len(text)

    def doc(self) -> Doc:
        return Doc("".join(self.parts), self.answers, self.kind)


def make_word(rng: random.Random, syllables: int) -> str:
    """A pronounceable made-up word such as ``kobulami``."""
    return "".join(rng.choice(CONSONANTS) + rng.choice(VOWELS) for _ in range(syllables))


def make_number(rng: random.Random, digits: int) -> str:
    """A random number with exactly ``digits`` digits (no leading zero)."""
    return str(rng.randint(10 ** (digits - 1), 10**digits - 1))


class Filler:
    """Irrelevant text of a requested size: the classic sentences, made-up prose, or code.

    Args:
        code_lines: lines of source text to draw code filler from (may be empty).
        kinds: which filler kinds to draw from.
    """

    def __init__(
        self, code_lines: list[str], kinds: tuple[str, ...] = ("classic", "prose", "code")
    ):
        if not code_lines:
            kinds = tuple(k for k in kinds if k != "code")
        if not kinds:
            raise ValueError("kinds must name at least one usable filler kind, got none")
        self.code_lines = code_lines
        self.kinds = kinds

    def __call__(self, rng: random.Random, n_tokens: int, kind: str | None = None) -> str:
        if n_tokens <= 0:
            return ""
        kind = kind or rng.choice(self.kinds)
        n_words = max(1, int(n_tokens / TOKENS_PER_WORD))
        if kind == "classic":
            # Whole sentences of the repeated five-sentence block (23 words per block).
            n_sentences = max(1, n_words * 5 // 23)
            return " ".join(CLASSIC_FILLER[i % 5] for i in range(n_sentences))
        if kind == "prose":
            return " ".join(self._sentence(rng) for _ in range(1 + n_words // 7))
        start = rng.randrange(len(self.code_lines))
        lines = self.code_lines[start : start + 1 + n_tokens // 8]
        return "\n".join(lines)[: n_tokens * 3]

    @staticmethod
    def _sentence(rng: random.Random) -> str:
        name = make_word(rng, 2).capitalize()
        templates = (
            "{n} walked to the {c} house near the river.",
            "{n} did not like the {c} {p} at all.",
            "In the morning {n} read a book about a {p}.",
            "Nobody knew why {n} painted the door {c}.",
            "{n} said that the weather was fine today.",
        )
        return rng.choice(templates).format(n=name, c=rng.choice(COLOURS), p=rng.choice(PETS))


def passkey_doc(
    rng: random.Random,
    n_tokens: int,
    filler: Filler,
    *,
    digits: int = 5,
    filler_kind: str | None = None,
) -> Doc:
    """One pass key stated at a random depth inside filler and asked for at the end."""
    key = make_number(rng, digits)
    b = Builder("passkey")
    b.add(
        "There is an important pass key hidden inside a lot of irrelevant text. "
        "Find it and memorize it. I will quiz you about the pass key.\n"
    )
    kind = filler_kind or rng.choice(filler.kinds)
    body = max(0, n_tokens - 60 - 2 * digits)
    before = int(body * rng.random())
    b.add(filler(rng, before, kind))
    b.add(f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n")
    b.add(filler(rng, body - before, kind))
    b.add("\nWhat is the pass key? The pass key is ")
    b.add(key, answer=True)
    b.add(".")
    return b.doc()


def kv_doc(rng: random.Random, n_tokens: int, filler: Filler) -> Doc:
    """A list of name -> code pairs, optional filler, then many out-of-order queries."""
    code_style = rng.random() < 0.4
    n_pairs = max(2, min(64, n_tokens // rng.choice((16, 24, 32))))
    names = list(dict.fromkeys(make_word(rng, rng.choice((2, 3))) for _ in range(n_pairs)))
    codes = {name: make_number(rng, rng.randint(2, 6)) for name in names}
    b = Builder("kv")
    if code_style:
        b.add("codes = {\n")
        for name in names:
            b.add(f'    "{name}": {codes[name]},\n')
        b.add("}\n")
    else:
        b.add("Here is a list of names and their codes.\n")
        for name in names:
            b.add(f"{name}: {codes[name]}\n")
    used = sum(len(n) // 3 + len(c) + 3 for n, c in codes.items()) + 12
    gap = int((n_tokens - used) * rng.random() * 0.5) if rng.random() < 0.5 else 0
    if gap > 0:
        b.add(filler(rng, gap) + "\n")
        used += gap
    b.add("# Queries\n" if code_style else "Now the codes again, in a different order.\n")
    while used < n_tokens:
        name = rng.choice(names)
        if code_style:
            b.add(f'assert codes["{name}"] == ')
        else:
            b.add(f"The code of {name} is ")
        b.add(codes[name], answer=True)
        b.add("\n" if code_style else ".\n")
        used += len(name) // 3 + len(codes[name]) + 8
    return b.doc()


def fact_doc(rng: random.Random, n_tokens: int, filler: Filler) -> Doc:
    """A few facts about made-up people at the start, long filler, questions at the end."""
    people = [make_word(rng, 2).capitalize() for _ in range(rng.randint(1, 3))]
    facts = []
    for p in people:
        facts += [
            (
                f"{p} lives in ",
                make_word(rng, 3).capitalize(),
                f"Where does {p} live? {p} lives in ",
            ),
            (
                f"The favourite colour of {p} is ",
                rng.choice(COLOURS),
                f"What is the favourite colour of {p}? It is ",
            ),
            (f"{p} has a pet ", rng.choice(PETS), f"Which pet does {p} have? {p} has a pet "),
            (
                f"The lucky number of {p} is ",
                make_number(rng, rng.randint(2, 5)),
                f"What is the lucky number of {p}? It is ",
            ),
        ]
    b = Builder("fact")
    b.add("Read the facts below; questions about them follow at the end.\n")
    for stem, value, _ in facts:
        b.add(f"{stem}{value}.\n")
    question_tokens = 14 * len(facts)
    b.add(filler(rng, n_tokens - 12 * len(facts) - question_tokens) + "\nQuestions.\n")
    rng.shuffle(facts)
    for _, value, question in facts:
        b.add(question)
        b.add(value, answer=True)
        b.add(".\n")
    return b.doc()


def copy_doc(rng: random.Random, n_tokens: int, filler: Filler) -> Doc:
    """A random segment (digit groups, made-up words or source lines) repeated 2-4 times.

    Every repeated token is predictable only by looking back, which is the signal that makes
    induction (copying) heads form; long documents put filler between the copies.
    """
    reps = rng.randint(2, 4)
    gap = int(n_tokens * rng.uniform(0.2, 0.6)) if n_tokens > 256 and rng.random() < 0.5 else 0
    seg_tokens = max(8, (n_tokens - gap - 8 * reps) // reps)
    style = rng.choice(("digits", "words", "code"))
    if style == "digits":
        groups = []
        while sum(len(g) + 1 for g in groups) < seg_tokens:
            groups.append(make_number(rng, rng.randint(1, 6)))
        segment = " ".join(groups)
    elif style == "words":
        segment = " ".join(make_word(rng, rng.randint(1, 3)) for _ in range(seg_tokens // 3 + 1))
    else:
        segment = filler(rng, seg_tokens, "code")
    b = Builder("copy")
    b.add("Copy the following text exactly.\n")
    b.add(segment)
    b.add("\n")
    if gap:
        b.add(filler(rng, gap) + "\n")
    for _ in range(reps - 1):
        b.add("Copy:\n")
        b.add(segment, answer=True)
        b.add("\n")
    return b.doc()


def chat_text(messages: list[dict[str, str]], bos: str) -> str:
    """Render messages exactly as the shipped chat template does (ChatML with a bos)."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return bos + turns


def chat_doc(
    rng: random.Random, n_tokens: int, filler: Filler, functions: list[dict], bos: str
) -> Doc:
    """A short system/user/assistant exchange; the assistant turn is the answer."""
    kind = rng.choice(("greet", "passkey", "kv", "arith", "doc", "code"))
    if kind in ("doc", "code") and not functions:
        kind = "arith"
    if kind == "greet":
        user = rng.choice(
            ("Hello!", "Hi", "Hi there, who are you?", "Good morning.", "Hey, what can you do?")
        )
        reply = (
            "Hello! I am qfserve-tiny, a small language model. I can recall facts and "
            "pass keys from long texts and talk about Python code. How can I help?"
        )
    elif kind == "passkey":
        inner = passkey_doc(rng, min(n_tokens, 400) - 40, filler)
        user = inner.text[: inner.answers[0][0]].rsplit("\n", 1)[0] + "\nWhat is the pass key?"
        key = inner.text[slice(*inner.answers[0])]
        reply = f"The pass key is {key}."
    elif kind == "kv":
        names = [make_word(rng, 2) for _ in range(rng.randint(2, 6))]
        codes = {n: make_number(rng, rng.randint(2, 5)) for n in names}
        name = rng.choice(names)
        user = "".join(f"{n}: {c}\n" for n, c in codes.items()) + f"What is the code of {name}?"
        reply = f"The code of {name} is {codes[name]}."
    elif kind == "arith":
        a, c = rng.randint(0, 999), rng.randint(0, 999)
        user = f"What is {a} + {c}?"
        reply = f"{a} + {c} = {a + c}."
    elif kind == "doc":
        f = rng.choice(functions)
        user = f"What does `{f['qualname']}` in the Python module `{f['module']}` do?"
        reply = f["doc"]
    else:
        f = rng.choice(functions)
        user = f"Show me the source of `{f['qualname']}` from the Python module `{f['module']}`."
        reply = f"```python\n{f['source']}\n```"
    messages = [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    if rng.random() < 0.5:
        messages.insert(0, {"role": "system", "content": "You are a helpful assistant."})
    text = chat_text(messages, bos)
    start = text.rindex(reply)
    return Doc(text, [(start, start + len(reply))], "chat")


RECALL_TEMPLATES = (
    "The pass key of {n} is ",
    "The code of {n} is ",
    "The secret number of {n} is ",
    "{n} = ",
)


def recall_doc(rng: random.Random, n_tokens: int, filler: Filler) -> Doc:
    """Named codes scattered through filler, then many out-of-order queries in the same words.

    Every query repeats its statement's words up to the code, so each answer is predictable by
    finding the one earlier sentence that shares its prefix, however far back: the dense,
    long-range copying signal pass-key retrieval needs (one pass key per document gives a few
    answer tokens; this gives dozens). With a single name it is a pass key asked many times.
    """
    per_line = 16  # rough tokens of one statement or query
    n_pairs = min(rng.choice((1, 1, 2, 4, 8, 16)), max(1, n_tokens // (3 * per_line)))
    if n_pairs == 1 and rng.random() < 0.5:
        template = "The pass key is "
        names = [""]
    else:
        template = rng.choice(RECALL_TEMPLATES)
        names = list(dict.fromkeys(make_word(rng, rng.choice((2, 3))) for _ in range(n_pairs)))
    codes = {name: make_number(rng, rng.randint(3, 6)) for name in names}
    kind = rng.choice(filler.kinds)
    # Each name is asked once, in a new order; sometimes a second round in yet another order.
    queries = rng.sample(names, len(names))
    if rng.random() < 0.5:
        queries += rng.sample(names, len(names))
    spare = max(0, n_tokens - 20 - per_line * (len(names) + len(queries)))
    cuts = sorted(rng.random() for _ in range(len(names)))
    shares = [b - a for a, b in zip([0.0, *cuts], [*cuts, 1.0], strict=True)]
    b = Builder("recall")
    b.add("Remember every code stated below; you will be asked for them.\n")
    for name, share in zip(rng.sample(names, len(names)), shares, strict=False):
        if int(spare * share) > 0:
            b.add(filler(rng, int(spare * share), kind) + "\n")
        b.add(f"{template.format(n=name)}{codes[name]}.\n")
    if int(spare * shares[-1]) > 0:
        b.add(filler(rng, int(spare * shares[-1]), kind) + "\n")
    b.add("Questions.\n")
    for name in queries:
        b.add(template.format(n=name))
        b.add(codes[name], answer=True)
        b.add(".\n")
    return b.doc()


# Order matters: the tokenizer corpus cycles through the first three.
GENERATORS: dict[str, Callable[..., Doc]] = {
    "passkey": passkey_doc,
    "kv": kv_doc,
    "fact": fact_doc,
    "copy": copy_doc,
    "recall": recall_doc,
}
