"""What ``qfserve`` defines, read from its source: modules, top-level names, classes and their
members (only a class with another library's bases is imported, to ask it); and every path
of the checkout. ``doc_names`` resolves the docs' citations against it."""

from __future__ import annotations

import ast
import functools
import importlib
import os
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "qfserve"
MODULES = sorted(PACKAGE.rglob("*.py"))
# Folders and files that are not the project's text.
SKIP_DIRS = frozenset(
    {".git", "__pycache__", ".venv", ".mypy_cache", ".ruff_cache", ".pytest_cache", "build"}
)


class ClassInfo:
    """A class's members as its source defines them, by name; its bases by their last name."""

    def __init__(self, module: str, qualname: str, node: ast.ClassDef):
        self.module, self.qualname = module, qualname
        self.bases = [_last(b) for b in node.bases]
        self.members: set[str] = set()
        self.declared: set[str] = set()  # fields and ``self.x``: not visible on the class
        for stmt in node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                self.members.add(stmt.name)
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                self.declared.add(stmt.target.id)
            elif isinstance(stmt, ast.Assign):
                self.members.update(n.id for t in stmt.targets for n in _names(t))
        for fn in node.body:
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                self.declared.update(
                    a.attr
                    for a in ast.walk(fn)
                    if isinstance(a, ast.Attribute)
                    and isinstance(a.ctx, ast.Store)
                    and getattr(a.value, "id", None) == "self"
                )
        self.members |= self.declared


def _last(node: ast.expr) -> str:
    node = node.value if isinstance(node, ast.Subscript) else node
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def _names(target: ast.expr) -> Iterator[ast.Name]:
    return (n for n in ast.walk(target) if isinstance(n, ast.Name))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def top_level(body: list[ast.stmt]) -> Iterator[str]:
    for stmt in body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            yield stmt.name
        elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
            targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
            yield from (n.id for t in targets for n in _names(t))
        elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
            yield from ((a.asname or a.name).split(".")[0] for a in stmt.names)
        elif isinstance(stmt, (ast.If, ast.Try, ast.With)):
            yield from top_level(stmt.body)
            for extra in ("orelse", "finalbody", "handlers"):
                for part in getattr(stmt, extra, []):
                    yield from top_level(
                        part.body if isinstance(part, ast.excepthandler) else [part]
                    )


class Index:
    """Every module, top-level name and class of ``qfserve``, read from the source."""

    def __init__(self, paths: list[Path]):
        self.modules: dict[str, Path] = {module_name(p): p for p in paths}
        self.top: dict[str, set[str]] = {}
        self.classes: dict[str, list[ClassInfo]] = {}
        for name, path in self.modules.items():
            tree = ast.parse(path.read_text())
            self.top[name] = set(top_level(tree.body))
            self._classes(name, "", tree.body)
        self.everything = set().union(*self.top.values(), (m.rsplit(".")[-1] for m in self.modules))
        for infos in self.classes.values():
            for info in infos:
                self.everything |= info.members
        self.packages = {
            m.rsplit(".")[-1] for m, p in self.modules.items() if p.name == "__init__.py"
        }

    def _classes(self, module: str, prefix: str, body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.ClassDef):
                info = ClassInfo(module, prefix + node.name, node)
                self.classes.setdefault(node.name, []).append(info)
                self._classes(module, info.qualname + ".", node.body)

    def has_member(self, info: ClassInfo, attr: str, seen: frozenset[str] = frozenset()) -> bool:
        if attr in info.members:
            return True
        for base in info.bases:
            if base not in seen and any(
                self.has_member(b, attr, seen | {base}) for b in self.classes.get(base, [])
            ):
                return True
        # External bases (mlx-lm's caches, ``NamedTuple``, pydantic): ask the class itself.
        cls = load(info.module)
        for part in info.qualname.split("."):
            cls = getattr(cls, part, None)
        return hasattr(cls, attr)


def load(module: str) -> object | None:
    """The imported module, or None where it cannot be imported (a ``__main__`` runs its CLI)."""
    if module.endswith("__main__"):
        return None
    try:
        return importlib.import_module(module)
    except Exception:
        return None


@functools.cache
def index() -> Index:
    return Index(MODULES)


@functools.cache
def repo_paths() -> frozenset[str]:
    """Every file and folder of the checkout, and every tail of their paths (``kv/evict.py``)."""
    tails: set[str] = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
        rel = Path(folder).relative_to(ROOT)
        for name in [*dirs, *files]:
            parts = (rel / name).parts
            tails.update("/".join(parts[i:]) for i in range(len(parts)))
    return frozenset(tails)
