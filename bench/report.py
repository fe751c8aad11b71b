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


def render_quality(results_dir: Path, title: str = "Quality", *, missing: bool = True) -> list[str]:
    """One quality section; ``missing=False`` leaves out studies that have not run."""
    lines = [f"## {title}", "", *quality_headlines(results_dir), ""]
    for name, render in QUALITY.items():
        path = results_dir / f"{name}.json"
        if path.exists():
            lines += [*render(json.loads(path.read_text())), ""]
        elif missing:
            lines += [f"*{name}: no results yet.*", ""]
    relative = (
        results_dir.relative_to(RESULTS_DIR.parent)
        if results_dir.is_relative_to(RESULTS_DIR.parent)
        else results_dir
    )
    # Renderers link plots as results/<file>; point them at this section's folder.
    return [line.replace("](results/", f"]({relative}/") for line in lines]


def render_default_model(results_dir: Path) -> list[str]:
    """The default model's section (``bench/results/smollm2/``), studies run so far."""
    if not results_dir.is_dir() or not any(results_dir.glob("*.json")):
        return []
    lines = render_quality(
        results_dir, "SmolLM2-135M-Instruct (the default model): quality", missing=False
    )
    structured = results_dir / "structured.json"
    if structured.exists():
        data = json.loads(structured.read_text())
        r, aa = data["ratios"]["schema/free"], data["ratios"]["free_again/free (A/A)"]
        ms = data["ms_per_token"]
        lines += [
            "### Structured output: what a JSON-schema constraint costs per token",
            "",
            f"`{data['command']}` — {data['when']}. Greedy decode, {data['reps']} interleaved "
            f"repetitions, {data['grammar_engine']}.",
            "",
            "| arm | ms/token median [q1–q3] |",
            "|---|---|",
            *[
                f"| {arm} | {s['median']:.1f} [{s['q1']:.1f}–{s['q3']:.1f}] |"
                for arm, s in ms.items()
            ],
            "",
            f"llguidance (served) schema/free = **{r['median']:.3f}** [{r['q1']:.3f}–"
            f"{r['q3']:.3f}] (A/A {aa['median']:.3f})"
            + (
                f"; outlines-core schema/free = {data['ratios']['schema_outlines/free']['median']:.3f}"
                if "schema_outlines/free" in data["ratios"]
                else ""
            )
            + ". Time inside the grammar processor per token: "
            + ", ".join(
                f"{lib} {v['median']:.2f} ms"
                for lib, v in data.get("processor_ms_per_token_by_library", {}).items()
            )
            + ".",
            "",
        ]
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
        *render_default_model(results_dir / "smollm2"),
        *render_quality(results_dir, "qfserve-tiny (the bundled test model): quality"),
        *render_speed(results_dir),
    ]
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    PAGE.write_text(render())
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
