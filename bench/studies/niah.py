"""A needle sentence in English prose, depth x length, per arm and compression.

The haystack is standard-library docstring prose; the needle "The special magic number for
<city> is <7 digits>." sits at a controlled depth, and the prompt ends with the question. The
prompt is prefilled once and handed to each arm's caches, as in the pass-key study.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

from bench.arms import Arm, add_arm_arguments, select_arms
from bench.data import stdlib_prose
from bench.harness import (
    Run,
    append_jsonl,
    open_run,
    parse,
    parser,
    progress,
    resume,
    save_plot,
    subplots,
)
from bench.report import arm_label, arm_order, fmt, plots, quality_header, table
from bench.studies.retrieval import answer_nll, budget_for, first_number_is, run_arm, shared_block

STUDY = "niah"
CITIES = (
    "Lisbon", "Nairobi", "Osaka", "Quito", "Tallinn", "Hanoi", "Accra", "Perth", "Bergen",
    "Cusco", "Dakar", "Tbilisi", "Malmo", "Recife", "Gdansk", "Kyoto", "Tunis", "Austin",
)  # fmt: skip
INTRO = "Read the text below. A special magic number is hidden in it; remember it.\n\n"


def default_arms() -> list[Arm]:
    """Full cache, then every method with a recent window of budget/4 (and the fallback's
    sign ablation)."""
    return [Arm("full"), Arm("qfilters", 0.25), Arm("knorm", 0.25), Arm("streaming", 0.0),
            Arm("fallback", 0.25), Arm("fallback", 0.25, sign=-1)]  # fmt: skip


def make_doc(
    tokenizer: Any, paragraphs: list[str], length: int, depth: float, index: int
) -> dict[str, Any]:
    """A prompt of at most ``length`` tokens (a few percent under, at a sentence end) with the
    needle at ``depth`` of the haystack."""
    rng = random.Random(f"niah-{length}-{depth}-{index}")
    city = rng.choice(CITIES)
    number = str(rng.randrange(1_000_000, 10_000_000))
    needle = f"The special magic number for {city} is {number}."
    question = (
        f"\n\nWhat is the special magic number for {city}? The special magic number for {city} is"
    )
    reserve = len(tokenizer.encode(INTRO + needle + question)) + 8
    start = rng.randrange(len(paragraphs))

    def build(room: int) -> tuple[list[int], float]:
        chosen: list[str] = []
        sizes: list[int] = []
        while not chosen or sum(sizes) < room:
            para = paragraphs[(start + len(chosen)) % len(paragraphs)]
            chosen.append(para)
            sizes.append(len(tokenizer.encode(para + "\n\n")))
        # Cut the last paragraph at a word so the haystack fits (it still ends a sentence).
        words = chosen[-1].split()
        while sum(sizes) > max(room, 1) and len(words) > 1:
            words = words[: max(1, len(words) * 3 // 4)]
            chosen[-1] = " ".join(words).rstrip(".,;:") + "."
            sizes[-1] = len(tokenizer.encode(chosen[-1] + "\n\n"))
        # The needle goes between paragraphs, at the boundary nearest to `depth` of the tokens.
        cumulative = np.concatenate([[0], np.cumsum(sizes)])
        slot = int(np.argmin(np.abs(cumulative - depth * cumulative[-1])))
        parts = [*chosen[:slot], needle, *chosen[slot:]]
        prompt = tokenizer.encode(INTRO + "\n\n".join(parts) + question)
        return prompt, float(cumulative[slot] / max(cumulative[-1], 1))

    # The whole text's tokens are not the sum of its paragraphs' (merges across the joins):
    # shrink the room by the overshoot until the prompt fits, never past the model's context.
    room = length - reserve
    prompt, where = build(room)
    while len(prompt) > length and room > 1:
        room = max(1, room - (len(prompt) - length + 4))
        prompt, where = build(room)
    if len(prompt) > length:
        raise ValueError(f"length {length} is too short for the needle and question")
    answer = tokenizer.encode(" " + number)[-len(tokenizer.encode(number)) :]
    return {"prompt": prompt, "number": number, "answer": answer, "depth": where,
            "tokens": len(prompt)}  # fmt: skip


def measure(study: Run, doc: dict[str, Any], ratios: list[int], arms: list[Arm]) -> dict:
    """Every arm at every ratio on one document: correct and answer NLL."""
    prompt, answer = doc["prompt"], doc["answer"]
    block = shared_block(study, prompt, arms)
    out: dict[str, dict[str, Any]] = {}
    for arm in arms:
        for ratio in [None] if arm.method == "full" else ratios:
            budget = None if ratio is None else budget_for(len(prompt), ratio, arm)
            if ratio is not None and budget is None:
                continue
            tokens, source = run_arm(study, prompt, block, arm, budget, len(answer) + 2)
            correct = first_number_is(study.tokenizer.decode(tokens), doc["number"])
            nll = answer_nll(study, prompt, answer, block, arm, budget)
            cell = {"correct": correct, "answer_nll": nll, "budget": budget,
                    "filter_source": source}  # fmt: skip
            out.setdefault(arm.name, {})["-" if ratio is None else str(ratio)] = cell
    return out


def aggregate(
    records: list[dict], lengths: list[int], depths: list[float], arms: list[Arm]
) -> dict:
    """``grid[arm][ratio]`` = accuracy matrix ``[depth][length]`` (None where not run)."""

    def accuracy(name: str, key: str, n: int, d: float) -> float | None:
        hits = [r["arms"][name][key]["correct"] for r in records if r["length"] == n
                and r["target_depth"] == d and key in r["arms"].get(name, {})]  # fmt: skip
        return float(np.mean(hits)) if hits else None

    grid: dict[str, dict[str, list[list[float | None]]]] = {}
    for arm in arms:
        keys = {k for r in records for k in r["arms"].get(arm.name, {})}
        for key in ["-"] if arm.method == "full" else sorted(keys, key=int):
            cells = [[accuracy(arm.name, key, n, d) for n in lengths] for d in depths]
            grid.setdefault(arm.name, {})[key] = cells
    return grid


def plot(grid: dict, lengths: list[int], depths: list[float], ratios: list[int],
         arms: list[Arm], out_dir: Any, title: str) -> None:  # fmt: skip
    """A heat map of accuracy (depth x length) per arm and ratio, the full cache first."""
    names = [a.name for a in arms if a.method != "full"]
    fig, ax = subplots(len(names) + 1, len(ratios),
                       figsize=(2.1 * len(ratios), 1.9 * (len(names) + 1)))  # fmt: skip
    for a in ax.flat:
        a.axis("off")

    def heat(a: Any, cells: list[list[float | None]], label: str) -> None:
        a.axis("on")
        data = np.array([[np.nan if v is None else v for v in row] for row in cells])
        a.imshow(data, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ticks = [f"{n // 1024}k" if n >= 1024 else str(n) for n in lengths]
        a.set_xticks(range(len(lengths)), ticks, fontsize=6)
        a.set_yticks(range(len(depths)), [f"{d:.0%}" for d in depths], fontsize=6)
        a.set_title(label, fontsize=7)

    heat(ax[0, 0], grid["full"]["-"], "full cache")
    for row, name in enumerate(names, start=1):
        for col, r in enumerate(ratios):
            if str(r) in grid.get(name, {}):
                heat(ax[row, col], grid[name][str(r)], f"{arm_label(name)}\n{r}x")
    save_plot(fig, out_dir, STUDY, title)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, calibration=True, lengths=([1024, 2048, 4096, 8192], [256], "prompt "
               "tokens"), depths=([0.0, 0.25, 0.5, 0.75, 1.0], [0.0, 1.0], "needle depths, 0..1"),
               ratios=([2, 4, 8, 16, 32], [4]), per_cell=(1, 1, "documents per depth x length"))  # fmt: skip
    add_arm_arguments(p)
    args = parse(p, argv)
    arms = select_arms(default_arms(), args)
    depths, ratios, per_cell = args.depths, args.ratios, args.per_cell
    study = open_run(STUDY, args, argv, calibrate=True)
    lengths = [n for n in args.lengths if n <= (study.identity["max_context"] or n)]
    paragraphs = stdlib_prose()
    log = args.out / f"{STUDY}.jsonl"
    done = resume(log, lambda r: (r["length"], r["target_depth"], r["index"]), fresh=args.quick)
    todo = [(n, d, i) for n in lengths for d in depths for i in range(per_cell)]
    with progress(total=len(todo), desc="documents") as bar:
        for n, d, i in todo:
            if (n, d, i) not in done:
                doc = make_doc(study.tokenizer, paragraphs, n, d, i)
                done[(n, d, i)] = {"length": n, "target_depth": d, "index": i,
                                   "depth": doc["depth"], "tokens": doc["tokens"],
                                   "model": study.identity["path"],
                                   "arms": measure(study, doc, ratios, arms)}  # fmt: skip
                append_jsonl(log, done[(n, d, i)])
            bar.update(1)
    records = [done[k] for k in todo]
    grid = aggregate(records, lengths, depths, arms)
    title = f"{study.identity['path']}: needle in prose"
    plot(grid, lengths, depths, ratios, arms, args.out, title)
    data = {"haystack": "paragraphs of Python standard-library docstrings (bench prose)",
            "needle": "The special magic number for <city> is <7 digits>.",
            "scoring": "first number of the greedy continuation equals the needle's",
            "docs_per_cell": per_cell}  # fmt: skip
    return study.save({"data": data, "lengths": lengths, "depths": depths, "ratios": ratios,
                       "arms": [a.name for a in arms],
                       "budget_rule": "budget = round(prompt tokens / ratio), recent = budget/4",
                       "grid": grid, "records": records, "plots": [f"{STUDY}.png"]})  # fmt: skip


def render(data: dict[str, Any]) -> list[str]:
    """This study's section of ``bench/RESULTS.md``."""
    lines = quality_header("Needle in a haystack, in prose", data)
    d = data["data"]
    lengths, depths, ratios = data["lengths"], data["depths"], data["ratios"]
    lines += [
        "",
        f'Haystack: {d["haystack"]}; needle: "{d["needle"]}", asked at the end; '
        f"{d['scoring']}. {d['docs_per_cell']} document(s) per depth x length "
        f"({', '.join(map(str, lengths))} tokens; depths {', '.join(f'{x:.0%}' for x in depths)}); "
        f"{data['budget_rule']}. Exact match, mean over the grid:",
        "",
    ]
    rows = []
    for name in arm_order(data["grid"]):
        if by_ratio := data["grid"].get(name):
            cells = [[v for line in by_ratio.get(k) or [] for v in line if v is not None]
                     for k in ["-", *map(str, ratios)]]  # fmt: skip
            rows.append([arm_label(name), *(fmt(sum(v) / len(v), 2) if v else "" for v in cells)])
    lines += table(["arm", "no eviction", *[f"{r}×" for r in ratios]], rows)
    return lines + plots(data)
