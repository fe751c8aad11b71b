"""Render ``bench/results/<model>/*.json`` into ``bench/RESULTS.md``: every figure on the page
comes from those files. The default model (SmolLM2-135M-Instruct, ``bench/results/smollm2/``)
comes first; the bundled test model's results (``bench/results/qfserve-tiny/``) follow,
labelled as such. Each model has a quality and a speed section, one renderer per study.

Run: ``python -m bench.report`` (after the studies; a missing study is listed, not an error).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.goals import render_goals
from bench.harness import RESULTS_DIR
from bench.quality.headlines import headlines as quality_headlines
from bench.quality.report import RENDERERS as QUALITY
from bench.quality.report import SUBFOLDER_STUDIES
from bench.speed.report import load_results, render_speed_section

PAGE = Path(__file__).resolve().parent / "RESULTS.md"

# (folder under bench/results, section title, list the studies that have not run)
MODELS = (
    ("smollm2", "SmolLM2-135M-Instruct (the default model)", True),
    (
        "smollm2/refinements",
        "SmolLM2-135M-Instruct: chunked and head-adaptive Q-Filters against plain (the "
        "retrieval study's adaptive rows are the first version, which compared raw expected "
        "logits across heads; the decode-step study's are the current one)",
        False,
    ),
    (
        "smollm2/refinements/adaptive",
        "SmolLM2-135M-Instruct: head-adaptive budgets ranked by expected log attention weights",
        False,
    ),
    (
        "smollm2/refinements/prompt",
        "SmolLM2-135M-Instruct: chunked Q-Filters against plain, perplexity after a prompt "
        "read in 512-token blocks",
        False,
    ),
    (
        "smollm2/selfcal",
        "SmolLM2-135M-Instruct: self-calibrated Q-Filters (no artifact) against calibrated, "
        "the key-SVD fallback and the query-aware references",
        False,
    ),
    (
        "smollm2/selfcal/lengths",
        "SmolLM2-135M-Instruct: does the score predict attention at 1k-8k tokens (calibrated, "
        "self-calibrated and traffic-learned Q-Filters, the fallback, SnapKV, K-norm, recency)",
        False,
    ),
    (
        "smollm2/traffic",
        "SmolLM2-135M-Instruct: Q-Filters learned from traffic (the server's default without an "
        "artifact) against calibrated, self-calibrated and the fallback",
        False,
    ),
    (
        "smollm2/traffic/8k",
        "SmolLM2-135M-Instruct: Q-Filters learned from traffic on 8k-token documents",
        False,
    ),
    (
        "smollm2/query_aware",
        "SmolLM2-135M-Instruct: the query-aware references (SnapKV, TOVA) beside calibrated, "
        "self-calibrated and fallback Q-Filters",
        False,
    ),
    (
        "smollm2/query_aware/8k",
        "SmolLM2-135M-Instruct: the query-aware comparison on 8k-token documents",
        False,
    ),
    (
        "smollm2/query_aware/window8",
        "SmolLM2-135M-Instruct: SnapKV with its default 32-token observation window and with "
        "an 8-token one (the question alone)",
        False,
    ),
    (
        "smollm2/kvzip",
        "SmolLM2-135M-Instruct: KVzip (context reconstruction) per head, across a layer's heads "
        "and with rows shared across layers, beside Q-Filters, K-norm, SnapKV and streaming "
        "(kvzip_reuse and kvzip_parity: bench/README.md)",
        False,
    ),
    (
        "smollm2/batching_16",
        "SmolLM2-135M-Instruct: continuous batching up to 16 streams (256-token prompts), after "
        "the packed batch's in-place joins and leaves, chunks of 8 by default",
        False,
    ),
    (
        "smollm2/multiturn_repeats",
        "SmolLM2-135M-Instruct: multi-turn reuse over repeated conversations",
        False,
    ),
    (
        "qfserve-tiny",
        "qfserve-tiny (the bundled 6-layer test model: what CI's smoke runs use; kept where "
        "it still says something)",
        False,
    ),
)


def render_quality(results_dir: Path, title: str = "Quality", *, missing: bool = True) -> list[str]:
    """One quality section; ``missing=False`` leaves out studies that have not run."""
    lines = [f"## {title}", "", *quality_headlines(results_dir), ""]
    for name, render in QUALITY.items():
        path = results_dir / f"{name}.json"
        if path.exists():
            lines += [*render(json.loads(path.read_text())), ""]
        elif missing and name not in SUBFOLDER_STUDIES:
            lines += [f"*{name}: no results yet (`python -m bench.quality.{name}`).*", ""]
    return lines


def render_model(results_dir: Path, title: str, *, missing: bool) -> list[str]:
    """A model's quality and speed sections, plots linked into its results folder."""
    if not results_dir.is_dir() or not any(results_dir.glob("*.json")):
        return []
    lines = [
        *render_quality(results_dir, f"{title}: quality", missing=missing),
        *render_speed_section(
            load_results(results_dir), f"{title}: speed and memory", missing=missing
        ),
    ]
    relative = (
        results_dir.relative_to(PAGE.parent)
        if results_dir.is_relative_to(PAGE.parent)
        else results_dir
    )
    # Renderers link plots as results/<file>; point them at this model's folder.
    return [line.replace("](results/", f"]({relative}/") for line in lines]


def render(results_dir: Path = RESULTS_DIR) -> str:
    lines = [
        "# qfserve benchmark results",
        "",
        f"Rendered by `python -m bench.report` on {time.strftime('%Y-%m-%d')} from "
        "`bench/results/<model>/*.json`; each section names the command and date of its run.",
        "",
        *render_goals(results_dir / MODELS[0][0]),
    ]
    for folder, title, missing in MODELS:
        lines += render_model(results_dir / folder, title, missing=missing)
    return "\n".join(lines).rstrip() + "\n"


def main() -> None:
    PAGE.write_text(render())
    print(f"wrote {PAGE}")


if __name__ == "__main__":
    main()
