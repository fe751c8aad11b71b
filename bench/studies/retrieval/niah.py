"""A needle sentence in English prose, depth x length, per arm and compression.

Standard-library docstring prose with "The special magic number for <city> is <7 digits>." at
a set depth, the question at the end; one prefill for every arm, as in the pass-key study.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from bench.arms import Arm, add_arm_arguments, select_arms
from bench.data import needle_doc, stdlib_prose
from bench.goals import grid_mean
from bench.plots import save_plot, subplots
from bench.report import arm_label, arm_order, fmt, section, table
from bench.run import start
from bench.studies.retrieval.retrieval import RULE, answers, by_arm

STUDY = "niah"
# Full cache, then every method with a recent window of budget/4 (and the fallback's ablation).
ARMS = (
    Arm("full"),
    Arm("qfilters", 0.25),
    Arm("knorm", 0.25),
    Arm("streaming", 0.0),
    Arm("fallback", 0.25),
    Arm("fallback", 0.25, sign=-1),
)


def grid_of(records: list[dict], names: list[str], lengths: list[int], depths: list[float]) -> dict:
    """``grid[arm][ratio]`` = accuracy matrix ``[depth][length]`` (None where not run)."""

    def accuracy(name: str, key: str, n: int, d: float) -> float | None:
        hits = [
            r["arms"][name][key]["correct"]
            for r in records
            if r["length"] == n and r["target_depth"] == d and key in r["arms"].get(name, {})
        ]
        return float(np.mean(hits)) if hits else None

    grid: dict[str, dict[str, list[list[float | None]]]] = {}
    for name in names:
        keys = {k for r in records for k in r["arms"].get(name, {})}
        for key in sorted(keys, key=lambda k: -1 if k == "-" else int(k)):
            cells = [[accuracy(name, key, n, d) for n in lengths] for d in depths]
            grid.setdefault(name, {})[key] = cells
    return grid


def plot(
    grid: dict, lengths: list[int], depths: list[float], ratios: list[int], out: Any, title: str
) -> None:
    """A heat map of accuracy (depth x length) per arm and ratio, the full cache first."""
    names = [name for name in grid if name != "full"]
    fig, ax = subplots(
        len(names) + 1, len(ratios), figsize=(2.1 * len(ratios), 1.9 * (len(names) + 1))
    )
    for a in ax.flat:
        a.axis("off")
    panels = [(ax[0, 0], grid["full"]["-"], "full cache")]
    panels += [
        (ax[row, col], grid[name][str(r)], f"{arm_label(name)}\n{r}x")
        for row, name in enumerate(names, start=1)
        for col, r in enumerate(ratios)
        if str(r) in grid[name]
    ]
    for a, cells, label in panels:
        a.axis("on")
        a.imshow(np.array(cells, dtype=float), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ticks = [f"{n // 1024}k" if n >= 1024 else str(n) for n in lengths]
        a.set_xticks(range(len(lengths)), ticks, fontsize=6)
        a.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=6)
        a.set_title(label, fontsize=7)
    save_plot(fig, out, STUDY, title)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    study = start(
        STUDY,
        argv,
        __doc__,
        calibration=True,
        options=[add_arm_arguments],
        lengths=([1024, 2048, 4096, 8192], [256], "prompt tokens"),
        depths=([0.0, 0.25, 0.5, 0.75, 1.0], [0.0, 1.0], "needle depths, 0..1"),
        ratios=([2, 4, 8, 16, 32], [4]),
        per_cell=(1, 1, "documents per depth x length"),
    )
    args = study.args
    arms = select_arms(list(ARMS), args)
    depths, ratios, per_cell = args.depths, args.ratios, args.per_cell
    lengths = [n for n in args.lengths if n <= (study.identity["max_context"] or n)]
    paragraphs = list(stdlib_prose())

    def measure(n: int, d: float, i: int) -> dict[str, Any]:
        doc = needle_doc(study.tokenizer, paragraphs, n, d, i)
        cells: dict[str, dict[str, Any]] = {}
        for arm, _, key, budget, _, source, right, nll in answers(
            study, {**doc, "key": doc["number"]}, by_arm(arms, ratios), len(doc["answer"]) + 2
        ):
            cells.setdefault(arm.name, {})[key] = {
                "correct": right,
                "answer_nll": nll,
                "budget": budget,
                "filter_source": source,
            }
        return {
            "length": n,
            "target_depth": d,
            "index": i,
            "depth": doc["depth"],
            "tokens": doc["tokens"],
            "model": study.identity["path"],
            "arms": cells,
        }

    todo = [(n, d, i) for n in lengths for d in depths for i in range(per_cell)]
    records = study.logged(("length", "target_depth", "index"), todo, measure, "documents")
    grid = grid_of(records, [a.name for a in arms], lengths, depths)
    plot(grid, lengths, depths, ratios, args.out, f"{study.identity['path']}: needle in prose")
    data = {
        "haystack": "paragraphs of Python standard-library docstrings (bench prose)",
        "needle": "The special magic number for <city> is <7 digits>.",
        "scoring": "first number of the greedy continuation equals the needle's",
        "docs_per_cell": per_cell,
    }
    return study.save(
        {
            "data": data,
            "lengths": lengths,
            "depths": depths,
            "ratios": ratios,
            "arms": [a.name for a in arms],
            "budget_rule": RULE,
            "grid": grid,
            "records": records,
            "plots": [f"{STUDY}.png"],
        }
    )


def render(data: dict[str, Any]) -> list[str]:
    d, lengths, depths, ratios = data["data"], data["lengths"], data["depths"], data["ratios"]
    intro = (
        f'Haystack: {d["haystack"]}; needle: "{d["needle"]}", asked at the end; '
        f"{d['scoring']}. {d['docs_per_cell']} document(s) per depth x length "
        f"({', '.join(map(str, lengths))} tokens; depths {', '.join(f'{x:.0%}' for x in depths)}); "
        f"{data['budget_rule']}. Exact match, mean over the grid:"
    )
    grid, keys = data["grid"], ["-", *map(str, ratios)]
    cell = lambda n, k: "" if (m := grid_mean(data, n, k)) is None else fmt(m, 2)  # noqa: E731
    rows = [[arm_label(n), *(cell(n, k) for k in keys)] for n in arm_order(grid) if grid[n]]
    headers = ["arm", "no eviction", *[f"{r}×" for r in ratios]]
    return section("Needle in a haystack, in prose", data, intro, table(headers, rows))
