"""Module size as a signal: modules of ``qfserve`` over :data:`REPORT` lines are listed in CI's
output (a module that grows is a candidate to split by concept); past :data:`LIMIT` the
layout test fails. Run: ``python -m tests.house.sizes``."""

from __future__ import annotations

from pathlib import Path

import qfserve

ROOT = Path(qfserve.__file__).parent
REPORT = 400  # listed: worth a look
LIMIT = 600  # refused: one module holds more than one concept


def sizes() -> dict[Path, int]:
    """Lines per module of the package."""
    return {p: len(p.read_text().splitlines()) for p in sorted(ROOT.rglob("*.py"))}


def report() -> str:
    """The modules over :data:`REPORT` lines, longest first."""
    over = sorted(((n, p) for p, n in sizes().items() if n > REPORT), reverse=True)
    if not over:
        return f"no module of qfserve is over {REPORT} lines"
    rows = [f"  {n:5d}  {p.relative_to(ROOT.parent)}" for n, p in over]
    return "\n".join([f"modules of qfserve over {REPORT} lines (refused past {LIMIT}):", *rows])


if __name__ == "__main__":
    print(report())
