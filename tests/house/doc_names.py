"""The checker behind ``test_doc_names``: the Python names and repository paths that the docs
(``README.md``, ``docs/*.md``, markdown inside ``qfserve``) and ``qfserve``'s docstrings and
comments cite, and whether each is real.

What is read: in markdown, inline code spans, link targets, and paths and ``python -m``
modules anywhere (code blocks too); in docstrings and comments, Sphinx roles
(``:meth:`Class.m```), double-backticked spans, paths and ``python -m`` modules.
How a name is resolved:

- ``qfserve.a.b.C.m`` and a partial path (``kv.factory.make_caches``): the module imported,
  then its attributes walked one by one (a dataclass or pydantic field, or an attribute set
  in a method, read from the source); from the source alone where the module does not import.
- ``Class.member``: some class of that name in ``qfserve`` (found by walking the source) has
  the member: method, property, class-body name or field, ``self.x``, or one it inherits.
- A role's bare name (``:func:`install```): defined somewhere in ``qfserve``; a leading dot
  (``:mod:`.selfcal```) is relative to the package, as in an import.
- ``a/b.py``, ``a/b.py:name``, ``dir/``: the path exists, from the repository root or as the
  tail of a path in it (``kv/evict.py``); a relative markdown link, from the file's folder.

Not ours to check: a lowercase head that spells no package path (``cache.budget``,
``tokenizer.ggml.pre``: a variable, a metadata key), names of other libraries (``mx.eval``),
file names other than sources (``config.json``), placeholders (``<cache>/models/``).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import io
import re
import sys
import tokenize
from collections.abc import Iterator
from pathlib import Path

from tests.house.source_index import (
    PACKAGE,
    ROOT,
    index,
    load,
    module_name,
    repo_paths,
    top_level,
)

DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(PACKAGE.rglob("*.md"))]

# Heads of names that belong to other libraries: the standard library's and these.
THIRD_PARTY = (
    {"mlx", "mlx_lm", "mx", "nn", "np", "numpy", "gguf", "tokenizers", "fastapi"}
    | {"pydantic", "torch", "kvpress", "transformers", "llguidance", "openai", "uvicorn", "cupy"}
    | {"llama_cpp"}
)
EXTERNAL = frozenset(THIRD_PARTY | sys.stdlib_module_names)
# Heads that are repository folders run as packages (``python -m tests.reliability``).
REPO_PACKAGES = ("bench", "tests", "training", "deploy")
# A dotted word that is a file name (``config.json``); a source file's must exist.
FILE_NAME = re.compile(
    r"[\w.-]+\.(py|cpp|h|c|cu|metal|sh|md|jsonl?|safetensors|gguf|html|cfg|toml|ya?ml|txt)"
)
SOURCE_FILE = re.compile(r".*\.(py|cpp|h|c|cu|metal|sh)")
# Names that no rule can resolve, each with its reason.
ALLOWED = {
    "ggml-common.h": "llama.cpp's header of block layouts, cited as the reference, not ours",
}

PY_ROLE = re.compile(r":(?:py:)?(mod|func|class|meth|attr|data|obj|exc|const):`([^`]+)`")
DOUBLE = re.compile(r"``([^`]+?)``")
MD_SPAN = re.compile(r"(`+)(.+?)\1")
MD_LINK = re.compile(r"\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
CALL_TAIL = re.compile(r"\([^()]*\)$")
PATH_WORD = re.compile(
    r"(?<![\w/.:~$<>-])(?:qfserve|bench|tests|docs|deploy|training|models)/[\w./-]*[\w/]"
)
PYTHON_M = re.compile(r"\bpython3? -m ([A-Za-z_][\w.]*)")
PLACEHOLDER = re.compile(r"[<>*{}$~\s]|\.\.\.|^/|^\.")


# --- resolving one cited name --------------------------------------------------------------


def resolve_qualified(dotted: str) -> bool:
    """``qfserve.x.y.Z.m``: the longest module prefix, then its attributes one by one."""
    parts = dotted.split(".")
    modules = index().modules
    i = max((i for i in range(1, len(parts) + 1) if ".".join(parts[:i]) in modules), default=0)
    if not i:
        return False
    obj = load(".".join(parts[:i]))
    if obj is None:
        return resolve_static(".".join(parts[:i]), parts[i:])
    for k, part in enumerate(parts[i:], start=i):
        if hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        # A dataclass or pydantic field, or an attribute set in ``__init__``.
        last = k == len(parts) - 1
        return last and isinstance(obj, type) and any(_declares(cls, part) for cls in obj.__mro__)
    return True


def resolve_static(module: str, rest: list[str]) -> bool:
    """The same walk on the source, for a module that does not import (or is a ``__main__``)."""
    if not rest:
        return True
    if rest[0] not in index().top[module]:
        return False
    qualname = rest[0]
    for k, part in enumerate(rest[1:], start=1):
        infos = [
            c
            for c in index().classes.get(qualname.rsplit(".")[-1], [])
            if (c.module, c.qualname) == (module, qualname)
        ]
        if not infos:
            return True  # an imported name or a value: its attributes are not in this module
        if f"{qualname}.{part}" in {c.qualname for c in index().classes.get(part, [])}:
            qualname = f"{qualname}.{part}"
            continue
        return k == len(rest) - 1 and index().has_member(infos[0], part)
    return True


def _declares(cls: type, attr: str) -> bool:
    return any(
        info.module == cls.__module__
        and info.qualname == cls.__qualname__
        and attr in info.declared
        for info in index().classes.get(cls.__name__, [])
    )


def resolve_suffix(parts: list[str], min_modules: int) -> bool | None:
    """``kv.factory.make_caches``: a module whose dotted name ends with the leading parts.
    None when fewer than ``min_modules`` leading parts spell the tail of a module's name."""
    for i in range(len(parts), min_modules - 1, -1):
        tail = "." + ".".join(parts[:i])
        found = [m for m in index().modules if ("." + m).endswith(tail)]
        if found:
            return any(resolve_qualified(".".join([m, *parts[i:]])) for m in found)
    return None


def resolve_in_class(parts: list[str]) -> bool | None:
    """``Class.member``: any class of that name defined in ``qfserve`` has the member. None
    when no class or top-level name of ``qfserve`` is called ``parts[0]``."""
    infos = index().classes.get(parts[0], [])
    owners = [m for m, names in index().top.items() if parts[0] in names and not infos]
    if not infos and not owners:
        return None
    if any(resolve_qualified(".".join([m, *parts])) for m in owners):
        return True
    for info in infos:
        if len(parts) == 2 and index().has_member(info, parts[1]):
            return True
        if resolve_qualified(".".join([info.module, info.qualname, *parts[1:]])):
            return True
    return False


def resolve_prose(name: str) -> bool | None:
    """A name in a code span; None where it is not ours to check (a variable, a library)."""
    name = CALL_TAIL.sub("", name)
    parts = name.split(".")
    head = parts[0]
    if head in EXTERNAL or len(parts) < 2:
        return None
    if head in REPO_PACKAGES:
        return resolve_repo_module(parts)
    if head == "qfserve":
        return resolve_qualified(name)
    if head[0].isupper():
        return bool(resolve_in_class(parts))  # an unknown class is a renamed one
    if head in index().packages:
        return bool(resolve_suffix(parts, 1))
    return resolve_suffix(parts, 2)


def resolve_role(target: str, module: str) -> bool:
    """A Sphinx role's target, seen from ``module`` (whose package a leading dot names)."""
    target = CALL_TAIL.sub("", target.split("<")[-1].rstrip(">").lstrip("~!"))
    if target.startswith("."):
        dots = len(target) - len(target.lstrip("."))
        is_package = index().modules[module].name == "__init__.py"
        base = module.split(".")[: len(module.split(".")) - dots + is_package]
        return resolve_qualified(".".join([*base, target[dots:]]))
    parts = target.split(".")
    if len(parts) == 1:
        return target in index().everything
    if parts[0] == "qfserve":
        return resolve_qualified(target)
    return bool(
        resolve_in_class(parts)
        or resolve_suffix(parts, 1)
        or resolve_qualified(".".join([module, *parts]))
    )


def resolve_repo_module(parts: list[str]) -> bool:
    """``bench.report`` or ``tests.reliability.main``: the module file, then a top-level name."""
    for i in range(len(parts), 0, -1):
        base = ROOT.joinpath(*parts[:i])
        for path in (base.with_suffix(".py"), base / "__init__.py", base / "__main__.py"):
            if path.is_file():
                rest = parts[i:]
                return not rest or (
                    len(rest) == 1 and rest[0] in set(top_level(ast.parse(path.read_text()).body))
                )
    return False


def resolve_path(cited: str, folder: Path = ROOT) -> bool:
    """A repository path, with an optional ``:name`` in the module it names."""
    path, _, name = cited.partition(":")
    path = path.rstrip("/")
    if not (path in repo_paths() or (folder / path).exists()):
        return False
    if not name or not path.endswith(".py"):
        return True
    matches = [
        m
        for m in index().modules
        if m.replace(".", "/") + ".py" == path
        or ("/" + m.replace(".", "/") + ".py").endswith("/" + path)
    ]
    return any(resolve_qualified(f"{m}.{name}") for m in matches)


def resolve_main(module: str) -> bool:
    """``python -m module``: ours (found by its file, nothing imported) or installed."""
    head = module.split(".")[0]
    if head == "qfserve":
        return module in index().modules
    if head in REPO_PACKAGES:
        return resolve_repo_module(module.split("."))
    return importlib.util.find_spec(module) is not None


def looks_like_path(word: str) -> bool:
    if "/" not in word or PLACEHOLDER.search(word) or "://" in word:
        return False
    stem = word.partition(":")[0]
    return (
        stem.endswith("/")
        or FILE_NAME.fullmatch(stem.rsplit("/", 1)[-1]) is not None
        or stem.split("/")[0] in {"qfserve", *REPO_PACKAGES, "docs", "models"}
    )


# --- what a text cites ---------------------------------------------------------------------


def check_span(span: str, where: str, folder: Path = ROOT) -> Iterator[str]:
    """Problems in one code span: a path, a file name or a dotted Python name."""
    span = span.strip()
    if span in ALLOWED:
        return
    if looks_like_path(span):
        if not resolve_path(span, folder):
            yield f"{where}: {span} (no such path)"
        return
    if FILE_NAME.fullmatch(span):
        if SOURCE_FILE.fullmatch(span) and span not in repo_paths():
            yield f"{where}: {span} (no such file)"
        return
    if DOTTED.fullmatch(CALL_TAIL.sub("", span)) and resolve_prose(span) is False:
        yield f"{where}: {span}"


def line_problems(line: str, where: str, spans: re.Pattern[str]) -> Iterator[str]:
    """Problems anywhere on a line: ``python -m`` modules, and paths outside its code spans
    (those are checked whole, with their ``:name``)."""
    for word in PATH_WORD.findall(spans.sub("", line)):
        if not resolve_path(word):
            yield f"{where}: {word} (no such path)"
    for module in PYTHON_M.findall(line):
        if not resolve_main(module):
            yield f"{where}: python -m {module} (no such module)"


def markdown_problems(text: str, where: str, folder: Path = ROOT) -> list[str]:
    problems: list[str] = []
    fenced = False
    for number, line in enumerate(text.splitlines(), start=1):
        at = f"{where}:{number}"
        if FENCE.match(line):
            fenced = not fenced
            continue
        problems.extend(line_problems(MD_LINK.sub("]", line), at, MD_SPAN))
        if fenced:
            continue
        for link in MD_LINK.findall(line):
            target = link.split("#")[0]
            if target and ":" not in target and not (folder / target).exists():
                problems.append(f"{at}: {link} (broken link)")
        for _, span in MD_SPAN.findall(line):
            problems.extend(check_span(span, at, folder))
    return problems


def source_problems(text: str, where: str, module: str, first_line: int = 1) -> list[str]:
    """Problems in a docstring or comment of ``module`` that starts on ``first_line``."""
    problems: list[str] = []
    for number, line in enumerate(text.splitlines(), start=first_line):
        at = f"{where}:{number}"
        for role, target in PY_ROLE.findall(line):
            if not resolve_role(target, module):
                problems.append(f"{at}: :{role}:`{target}`")
        line = PY_ROLE.sub("", line)
        for span in DOUBLE.findall(line):
            problems.extend(check_span(span, at))
        problems.extend(line_problems(line, at, DOUBLE))
    return problems


def module_texts(path: Path) -> Iterator[tuple[str, int]]:
    """A module's docstrings and comments, each with the line it starts on."""
    source = path.read_text()
    for node in ast.walk(ast.parse(source)):
        kinds = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
        if isinstance(node, kinds) and (doc := ast.get_docstring(node, clean=False)):
            yield doc, node.body[0].lineno
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.string, token.start[0]


def docstring_problems(path: Path) -> list[str]:
    where = str(path.relative_to(ROOT))
    module = module_name(path)
    return [
        p for text, line in module_texts(path) for p in source_problems(text, where, module, line)
    ]
