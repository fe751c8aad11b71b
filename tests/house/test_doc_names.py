"""Docs that cannot drift: every Python name and repository path that the docs and
``qfserve``'s docstrings and comments cite is real (the rules are in ``doc_names``)."""

from __future__ import annotations

import pytest

from tests.house.doc_names import (
    CALL_TAIL,
    DOCS,
    DOTTED,
    MD_SPAN,
    PY_ROLE,
    docstring_problems,
    markdown_problems,
    module_texts,
    resolve_prose,
    resolve_qualified,
    source_problems,
)
from tests.house.source_index import MODULES, PACKAGE, ROOT


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_name_a_doc_cites_is_real(path):
    problems = markdown_problems(path.read_text(), str(path.relative_to(ROOT)), path.parent)
    assert not problems, "cited but not found:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_every_name_a_docstring_cites_is_real(path):
    problems = docstring_problems(path)
    assert not problems, "cited but not found:\n" + "\n".join(problems)


def test_the_checker_reads_what_the_docs_cite():
    spans = [
        s for d in DOCS for line in d.read_text().splitlines() for _, s in MD_SPAN.findall(line)
    ]
    names = [s for s in spans if DOTTED.fullmatch(CALL_TAIL.sub("", s)) and resolve_prose(s)]
    roles = [r for m in MODULES for text, _ in module_texts(m) for r in PY_ROLE.findall(text)]
    assert len(names) >= 30 and len(roles) >= 200, (len(names), len(roles))


GOOD = """\
`qfserve.engine.kv.cache.EvictionCache.compress`, `EvictionCache.update_and_fetch()`,
`kv.cache.EvictionCache`, `server.settings.Settings`, `cache.budget`, `mx.fast.rope`,
`config.json`, `qfserve/engine/kv/cache.py`, `kv/cache.py`, `text/sampling.py:request_sampler`,
`bench/studies/kernel_cuda.py`, `python -m qfserve.server.docgen`, [API](docs/api.md#endpoints).
"""
BAD = """\
`qfserve.engine.kv.cache.EvictionCache.no_such_method`, `EvictionCache.no_such_method`,
`kv.cache.NoSuchCache`, `NoSuchClass.step`, `bench/kernel_cuda.py`,
`text/sampling.py:no_such_sampler`, `python -m calibrations`, [gone](docs/no_such_page.md).
"""


def test_the_checker_passes_real_names_and_reports_missing_ones():
    assert markdown_problems(GOOD, "good.md") == []
    problems = markdown_problems(BAD, "bad.md")
    assert len(problems) == 8, problems
    assert "bad.md:1: EvictionCache.no_such_method" in problems


def test_the_checker_reads_roles_relative_to_their_package():
    good = ":mod:`.sources`, :meth:`EvictionCache.compress`, :func:`~qfserve.kernels.use_backend`"
    assert source_problems(good, "x.py", "qfserve.kernels") == []
    assert source_problems(":mod:`.sources`", "x.py", "qfserve.kernels.backend") == []
    bad = ":mod:`.no_such`, :meth:`EvictionCache.no_such`, :func:`no_such_function`, ``bench/gone.py``"
    assert len(source_problems(bad, "x.py", "qfserve.kernels")) == 4


def test_a_method_dropped_from_its_class_is_reported(monkeypatch):
    from qfserve.engine.kv.cache import EvictionCache

    name = "qfserve.engine.kv.cache.EvictionCache.compress"
    assert resolve_qualified(name)
    monkeypatch.delattr(EvictionCache, "compress")
    assert not resolve_qualified(name)
    assert markdown_problems(f"`{name}`", "doc.md") == [f"doc.md:1: {name}"]
