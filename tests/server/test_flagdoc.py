"""The flag table in docs/configuration.md is generated from the parser: stale is a failure."""

from __future__ import annotations

from qfserve.server.flagdoc import DOC, flag_table, render
from qfserve.server.settings import EnvDefaults, make_parser


def test_the_documented_flag_table_is_the_parsers():
    doc = DOC.read_text()
    assert render(doc) == doc, "docs/configuration.md is stale: python -m qfserve.server.flagdoc"


def test_every_flag_and_variable_is_in_the_table():
    table = flag_table()
    parser = make_parser(EnvDefaults.model_construct())
    for action in parser._actions:
        for option in action.option_strings:
            if option not in ("-h", "--help", "--version"):
                assert f"`{option}`" in table
    for name in EnvDefaults.model_fields:
        assert f"`QFSERVE_{name.upper()}`" in table
