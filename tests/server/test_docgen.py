"""The flag table (docs/configuration.md) and the OpenAI-compatibility table (docs/api.md) are
generated from the code: stale is a failure."""

from __future__ import annotations

import pytest

from qfserve.server.compat import CHAT_FATES, COMPLETION_FATES, EXTENSION_FATES
from qfserve.server.docgen import COMPAT, FLAGS, TABLES, compat_table, flag_table, render
from qfserve.server.settings import EnvDefaults, make_parser


@pytest.mark.parametrize("table", list(TABLES), ids=lambda t: t.name)
def test_the_documented_tables_are_the_codes(table):
    doc = table.doc.read_text()
    assert render(table, doc) == doc, f"{table.doc} is stale: python -m qfserve.server.docgen"


def test_every_flag_and_variable_is_in_the_table():
    table = flag_table()
    parser = make_parser(EnvDefaults.model_construct())
    for action in parser._actions:
        for option in action.option_strings:
            if option not in ("-h", "--help", "--version"):
                assert f"`{option}`" in table
    for name in EnvDefaults.model_fields:
        assert f"`QFSERVE_{name.upper()}`" in table
    assert FLAGS.begin in FLAGS.doc.read_text()


def test_every_parameter_is_in_the_compatibility_table():
    table = compat_table()
    rows = table.splitlines()
    for fates in (CHAT_FATES, COMPLETION_FATES, EXTENSION_FATES):
        for name, (fate, what) in fates.items():
            named = [r for r in rows if r.startswith((f"| `{name}` |", f"| `{name} ("))]
            assert any(f"| {fate} | {what} |" in r for r in named), name
    assert COMPAT.begin in COMPAT.doc.read_text()
