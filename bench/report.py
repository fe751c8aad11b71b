"""Render ``bench/results/*.json`` into ``bench/RESULTS.md``: every figure on the page comes
from those files. One renderer per study, grouped in two sections.

Run: ``python -m bench.report`` (after the studies; a missing study is listed, not an error).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness import RESULTS_DIR
from bench.quality.report import RENDERERS as QUALITY_RENDERERS
from bench.quality.report import headlines as quality_headlines

PAGE = Path(__file__).resolve().parent / "RESULTS.md"
Renderer = Callable[[dict[str, Any]], list[str]]


# -- Quality (studies 1-5) -------------------------------------------------------------------
# One renderer per study: QUALITY[<json name>] = function(json dict) -> markdown lines.
QUALITY: dict[str, Renderer] = dict(QUALITY_RENDERERS)


def render_quality(results_dir: Path) -> list[str]:
    lines = ["## Quality", "", *quality_headlines(results_dir), ""]
    for name, render in QUALITY.items():
        path = results_dir / f"{name}.json"
        if path.exists():
            lines += [*render(json.loads(path.read_text())), ""]
        else:
            lines += [f"*{name}: no results yet.*", ""]
    if not QUALITY:
        lines += ["*Studies 1–5: renderers not written yet.*", ""]
    return lines


# -- Speed and memory (studies 6-10) -----------------------------------------------------------


def render_speed(results_dir: Path) -> list[str]:
    from bench.speed.report import load_results, render_speed_section

    return render_speed_section(load_results(results_dir))


def render(results_dir: Path = RESULTS_DIR) -> str:
    lines = [
        "# qfserve benchmark results",
        "",
        f"Rendered by `python -m bench.report` on {time.strftime('%Y-%m-%d')} from "
        "`bench/results/*.json`; each section names the command and date of its run.",
        "",
        *render_quality(results_dir),
        *render_speed(results_dir),
    ]
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    PAGE.write_text(render())
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
