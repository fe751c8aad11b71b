"""The flag table of ``docs/configuration.md``, generated from the parser itself, so the
documented flags, their ``QFSERVE_*`` variables and defaults cannot drift from the code.

Run ``python -m qfserve.server.flagdoc`` to rewrite the table between its markers;
``tests/server/test_flagdoc.py`` fails while the file is stale.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qfserve.server.settings import EnvDefaults, make_parser

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
BEGIN, END = "<!-- flags:begin (python -m qfserve.server.flagdoc) -->", "<!-- flags:end -->"


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
        if action.dest == "self_calibration" and isinstance(action, argparse._StoreConstAction):
            env = ""  # --no-self-calibration: a spelling of --self-calibration off
        raw = formatter._expand_help(action) if action.help else ""
        text = " ".join(raw.split()).replace("|", "\\|")
        rows.append(f"| {flags} | {env} | {text} |")
    return "\n".join(rows)


def render(doc: str) -> str:
    """``doc`` with the table between its markers replaced by the generated one."""
    start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
    return doc[:start] + "\n" + flag_table() + "\n" + doc[end:]


def main() -> int:
    DOC.write_text(render(DOC.read_text()))
    print(f"wrote {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
