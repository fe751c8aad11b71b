"""The tables the docs hold, generated from the code that defines them, so what is documented
cannot drift from what runs: the flag table of ``docs/configuration.md`` (every flag, its
``QFSERVE_*`` variable and default, from the parser itself) and the OpenAI-compatibility
table of ``docs/api.md`` (every request parameter's fate, from :mod:`qfserve.server.compat`).

Run ``python -m qfserve.server.docgen`` to rewrite both between their markers;
``tests/server/test_docgen.py`` fails while either file is stale.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from qfserve.server.compat import CHAT_FATES, COMPLETION_FATES, EXTENSION_FATES
from qfserve.server.settings import EnvDefaults, make_parser

DOCS = Path(__file__).resolve().parents[2] / "docs"


@dataclass(frozen=True)
class Table:
    """A generated table: the file it lives in, between ``<!-- {name}:begin ... -->`` and
    ``<!-- {name}:end -->``."""

    name: str
    doc: Path

    @property
    def begin(self) -> str:
        return f"<!-- {self.name}:begin (python -m qfserve.server.docgen) -->"

    @property
    def end(self) -> str:
        return f"<!-- {self.name}:end -->"


FLAGS = Table("flags", DOCS / "configuration.md")
COMPAT = Table("compat", DOCS / "api.md")


def flag_table(parser: argparse.ArgumentParser | None = None) -> str:
    """One row per flag: its spellings, its environment variable, what it does."""
    # The table must not depend on this machine's QFSERVE_* variables: built from the
    # code's own defaults.
    parser = parser or make_parser(EnvDefaults.model_construct())
    formatter = parser._get_formatter()
    env_names = set(EnvDefaults.model_fields)
    rows = ["| flag | environment | what it does |", "| --- | --- | --- |"]
    for action in parser._actions:
        if not action.option_strings or action.dest in ("help", "version"):
            continue
        flags = ", ".join(f"`{o}`" for o in action.option_strings)
        if action.choices:
            flags += " " + "/".join(f"`{c}`" for c in action.choices)
        env = f"`QFSERVE_{action.dest.upper()}`" if action.dest in env_names else ""
        if type(action) is argparse._StoreConstAction:
            env = ""  # a spelling of one value of another flag (--no-self-calibration)
        raw = formatter._expand_help(action) if action.help else ""
        text = " ".join(raw.split()).replace("|", "\\|")
        rows.append(f"| {flags} | {env} | {text} |")
    return "\n".join(rows)


def compat_table() -> str:
    """One row per request parameter: chat's, then those of text completions alone, then the
    extensions."""
    rows = ["| parameter | fate | what happens |", "| --- | --- | --- |"]
    only_completions = {k: v for k, v in COMPLETION_FATES.items() if CHAT_FATES.get(k) != v}
    for fates, suffix in (
        (CHAT_FATES, ""),
        (only_completions, " (completions)"),
        (EXTENSION_FATES, ""),
    ):
        for name, (fate, what) in fates.items():
            label = name if name.endswith(")") else name + suffix
            rows.append(f"| `{label}` | {fate} | {what.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)


TABLES = {FLAGS: flag_table, COMPAT: compat_table}


def render(table: Table, doc: str) -> str:
    """``doc`` with ``table`` between its markers replaced by the generated one."""
    start, end = doc.index(table.begin) + len(table.begin), doc.index(table.end)
    return doc[:start] + "\n" + TABLES[table]() + "\n" + doc[end:]


def main() -> int:
    for table in TABLES:
        table.doc.write_text(render(table, table.doc.read_text()))
        print(f"wrote {table.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
