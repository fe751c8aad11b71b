"""The package's shape stays readable: no module of ``qfserve`` is past the size at which it
must hold more than one concept (:mod:`tests.house.sizes`, whose report of the modules worth a
look CI prints), and every package opens with a docstring saying what its room holds."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import qfserve
from tests.house import sizes

ROOT = Path(qfserve.__file__).parent
MODULES = sorted(ROOT.rglob("*.py"))
PACKAGES = sorted(p for p in MODULES if p.name == "__init__.py")


def test_the_walk_finds_the_package():
    assert len(MODULES) > 50 and (ROOT / "engine" / "kv" / "__init__.py") in PACKAGES


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_is_past_the_limit(path):
    lines = len(path.read_text().splitlines())
    assert lines <= sizes.LIMIT, f"{path.relative_to(ROOT)} has {lines} lines: split it by concept"


def test_the_report_lists_exactly_the_modules_over_its_threshold():
    listed = sizes.report()
    for path, lines in sizes.sizes().items():
        named = str(path.relative_to(ROOT.parent)) in listed
        assert named == (lines > sizes.REPORT), path


@pytest.mark.parametrize("path", PACKAGES, ids=lambda p: str(p.parent.relative_to(ROOT)))
def test_every_package_says_its_role(path):
    doc = ast.get_docstring(ast.parse(path.read_text()))
    assert doc and len(doc.split()) >= 5, f"{path.relative_to(ROOT)} has no docstring"
