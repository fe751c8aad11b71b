"""The package's shape stays readable: every module of ``qfserve`` holds one concept in at
most 400 lines, and every package opens with a docstring saying what its room holds."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import qfserve

ROOT = Path(qfserve.__file__).parent
MODULES = sorted(ROOT.rglob("*.py"))
PACKAGES = sorted(p for p in MODULES if p.name == "__init__.py")


def test_the_walk_finds_the_package():
    assert len(MODULES) > 50 and (ROOT / "engine" / "kv" / "__init__.py") in PACKAGES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_is_over_400_lines(path):
    lines = len(path.read_text().splitlines())
    assert lines <= 400, f"{path.relative_to(ROOT)} has {lines} lines"


@pytest.mark.parametrize("path", PACKAGES, ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_every_package_says_its_role(path):
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and len(doc.split()) >= 5, f"{path.relative_to(ROOT)} has no docstring"
