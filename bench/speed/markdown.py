"""Markdown pieces the speed renderers share: ratio cells, tables, headers, plots."""

from __future__ import annotations

from typing import Any

MiB = 2**20


def _r(row: dict[str, Any]) -> str:
    """A paired-ratio row as ``median [q1-q3]``."""
    return f"{row['median']:.3f} [{row['q1']:.2f}–{row['q3']:.2f}]"


def _ms(s: dict[str, float], scale: float = 1.0, digits: int = 2) -> str:
    return f"{s['median'] * scale:.{digits}f} [{s['q1'] * scale:.{digits}f}–{s['q3'] * scale:.{digits}f}]"


def _table(headers: list[str], rows: list[list[Any]]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out


def _header(title: str, data: dict[str, Any]) -> list[str]:
    m = data["machine"]
    notes = m.get("notes", "")
    lines = [
        f"### {title}",
        "",
        f"`{data['command']}` — {data['when']}, {data.get('runtime_s', '?')} s; "
        f"{m['processor']}, {m.get('cpu_count', '?')} cores, {m['device']}, MLX {m['mlx']}, "
        f"load average {m.get('load_average', '?')}. {m['blas']}.",
    ]
    if notes:
        lines += ["", f"*Machine note: {notes}.*"]
    if data.get("quick"):
        lines += ["", "*Quick (CI-sized) run: not a measurement.*"]
    return [*lines, ""]


def _plots(data: dict[str, Any]) -> list[str]:
    return ["", *(f"![{p}](results/{p})" for p in data.get("plots", [])), ""]
