"""Whose queries make a prompt-calibrated filter work on the pass key?

The document's own queries (``own``), another text's (``other``) or the artifact's
(``calibrated``): accuracy and the share of the key's rows kept.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from bench.arms import Arm, feed_block
from bench.data import passkey_docs, stdlib_windows
from bench.harness import Run, color, progress, save_plot, start, subplots
from bench.report import section
from bench.studies import retrieval as rt
from bench.studies.attention import self_filters
from qfserve.engine.kv.cache import EvictionCache

STUDY = "selfcal_text"
NAMES = ("full", "calibrated", "own", "other", "streaming")
# The cache each source or reference runs with (a recent window of budget/4).
ARMS = {"full": Arm("full", 0.0), "streaming": Arm("streaming", 0.0),
        "calibrated": Arm("qfilters", 0.25), "own": Arm("self", 0.25),
        "other": Arm("qfilters", 0.25)}  # fmt: skip
METHOD_OF = {"calibrated": "qfilters", "own": "self", "other": "fallback", "streaming": "streaming"}


def block_filters(block: list[tuple[mx.array, ...]]) -> mx.array:
    """``(n_layers, n_kv_heads, D)`` filters from a prefill block's rotated queries."""
    return mx.stack([self_filters(queries[0], keys.shape[1]) for keys, _, queries in block])


def needle_rows(prompt: list[int], answer: list[int]) -> list[int]:
    """Positions of every occurrence of the key's digit tokens in ``prompt``."""
    digits = answer[1:] if len(answer) > 1 else answer  # answer is " " + key
    n = len(digits)
    hits = [i for i in range(len(prompt) - n + 1) if prompt[i : i + n] == digits]
    return sorted({i + j for i in hits for j in range(n)})


def share_kept(caches: list[Any], block: list[tuple[mx.array, ...]], rows: list[int]) -> float:
    """Mean over layers and KV heads of the share of ``rows`` whose keys the cache holds."""
    shares = []
    for cache, (keys, *_) in zip(caches, block, strict=True):
        if not isinstance(cache, EvictionCache) or cache.keys is None:
            continue
        kept = np.array(cache.keys[0].astype(mx.float32))  # (H, budget, D)
        full = np.array(keys[0].astype(mx.float32))  # (H, N, D)
        for h in range(full.shape[0]):
            held = {r.tobytes() for r in kept[h]}  # rows are gathered, not recomputed
            shares.append(np.mean([full[h, p].tobytes() in held for p in rows]))
    if not rows or not shares:
        raise ValueError("no needle rows to look for: the key's tokens are not in the prompt")
    return float(np.mean(shares))


def measure_doc(study: Run, doc: dict[str, Any], other: mx.array, ratios: list[int]) -> dict:
    """Every source and reference at every ratio on one document."""
    model, prompt = study.model, doc["prompt"]
    block = rt.prefill_block(model, prompt, queries=True)
    filters = {"calibrated": mx.array(np.asarray(study.filters)), "other": other}
    rows = needle_rows(prompt, doc["answer"])

    def outcome(name: str, budget: int | None) -> dict[str, Any]:
        caches = ARMS[name].caches(model, budget, filters.get(name))
        feed_block(caches, block)  # only `own`'s caches take the queries
        kept = share_kept(caches, block, rows) if budget is not None else 1.0
        text = study.tokenizer.decode(rt.decode(model, prompt[-1:], caches, doc["key_tokens"] + 2))
        return {"correct": rt.first_number_is(text, doc["key"]), "needle_rows_kept": kept,
                "budget": budget, "source": ARMS[name].source(caches)}  # fmt: skip

    cells: dict[str, dict[str, Any]] = {"full": {"-": outcome("full", None)}}
    for ratio in ratios:
        for name in NAMES[1:]:
            if (budget := rt.budget_for(len(prompt), ratio, ARMS[name])) is not None:
                cells.setdefault(name, {})[str(ratio)] = outcome(name, budget)
    cal = np.asarray(study.filters)
    cosine = {"own": float((np.array(block_filters(block)) * cal).sum(-1).mean()),
              "other": float((np.array(other) * cal).sum(-1).mean())}  # fmt: skip
    return {"bin": doc["bin"], "depth": doc["depth"], "needle_rows": len(rows), "cells": cells,
            "cosine_to_calibrated": cosine}  # fmt: skip


def aggregate(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per arm and ratio: accuracy and mean needle rows kept, over the records."""
    out: dict[str, dict[str, dict[str, float]]] = {}
    for name in NAMES:
        keys = {k for r in records for k in r["cells"].get(name, {})}
        for key in sorted(keys, key=lambda k: -1 if k == "-" else int(k)):
            cells = [r["cells"][name][key] for r in records if key in r["cells"].get(name, {})]
            out.setdefault(name, {})[key] = {
                "accuracy": float(np.mean([c["correct"] for c in cells])),
                "needle_rows_kept": float(np.mean([c["needle_rows_kept"] for c in cells])),
                "docs": len(cells),
            }
    return out


def plot(results: dict[str, Any], ratios: list[int], out: Any, title: str) -> str:
    """Accuracy and needle rows kept against compression, a column per filler."""
    fig, ax = subplots(2, len(results), sharey="row")
    style = lambda name: {"color": color(METHOD_OF.get(name, "full")), "label": name}  # noqa: E731
    for j, (filler, res) in enumerate(results.items()):
        for i, (metric, label) in enumerate(
            (("accuracy", "pass-key accuracy"), ("needle_rows_kept", "needle rows kept"))
        ):
            series = {n: {k: c[metric] for k, c in by.items()} for n, by in res["arms"].items()}
            rt.ratio_panel(ax[i, j], series if i == 0 else {**series, "full": {}}, ratios, style)
            ax[i, j].set_ylim(-0.05, 1.05)
            ax[i, j].set_title(f"{filler} filler: {label}", fontsize=9)
    ax[0, 0].legend(fontsize=7)
    return save_plot(fig, out, STUDY, title)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    study = start(STUDY, argv, __doc__, calibration=True, lengths=([1024], [320]),
                  ratios=([2, 4, 8], [2, 4]), per_bin=(2, 1, "documents per depth bin"),
                  fillers=(["classic", "prose"], ["classic"], "of classic, prose, code"))  # fmt: skip
    args = study.args
    lengths, ratios, per_bin, fillers = args.lengths, args.ratios, args.per_bin, args.fillers
    results: dict[str, Any] = {}
    with progress(total=len(fillers) * len(lengths) * per_bin * len(rt.BINS), desc="docs") as bar:
        for filler in fillers:
            records = []
            for n in lengths:
                window = [int(t) for t in stdlib_windows(study.corpus, n, 1)[0]]
                other = block_filters(rt.prefill_block(study.model, [*window, 0], queries=True))
                for doc in passkey_docs(study.corpus, n, per_bin, len(rt.BINS), filler_kind=filler):
                    records.append({"length": n, **measure_doc(study, doc, other, ratios)})
                    bar.update(1)
            cosine = {k: float(np.mean([r["cosine_to_calibrated"][k] for r in records]))
                      for k in ("own", "other")}  # fmt: skip
            results[filler] = {"arms": aggregate(records), "cosine_to_calibrated": cosine,
                               "records": records}  # fmt: skip
    data = {"documents": "retrieval's held-out pass-key documents, spread over depth thirds",
            "other_text": "an equal-length evaluation-split standard-library window",
            "scoring": "first number of the greedy answer equals the key",
            "needle_rows_kept": "share of the key's digit rows each layer and KV head holds "
            "after the prompt, mean over layers and heads"}  # fmt: skip
    title = f"{study.identity['path']}: whose queries calibrate"
    return study.save({"data": data, "lengths": lengths, "ratios": ratios, "fillers": fillers,
                       "budget_rule": rt.RULE, "results": results,
                       "plots": [plot(results, ratios, args.out, title)]})  # fmt: skip


def render(data: dict[str, Any]) -> list[str]:
    d, ratios = data["data"], data["ratios"]
    blocks: list[str | list[str]] = [
        f"The self-calibration recipe fed different queries, on {d['documents']} "
        f"({', '.join(map(str, data['lengths']))} tokens): `own` is the document's own "
        f"prompt (the server's `self` caches, fed the prompt as one block), `other` "
        f"{d['other_text']}, `calibrated` the registry's artifact; {data['budget_rule']} "
        f"(streaming: none). Each cell: accuracy ({d['scoring']}) / {d['needle_rows_kept']}."
    ]
    for filler, res in data["results"].items():
        cos, full = res["cosine_to_calibrated"], res["arms"]["full"]["-"]["accuracy"]
        blocks.append(f"**{filler} filler** (full cache {full:.2f}; mean cosine to the calibrated "
                      f"filters: own {cos['own']:.3f}, other {cos['other']:.3f}):")  # fmt: skip
        arms = {name: cells for name, cells in res["arms"].items() if name != "full"}
        blocks.append(rt.ratio_table("filters", ratios, arms, lambda cells, r: f"{c['accuracy']:.2f} / "
                      f"{c['needle_rows_kept']:.2f}" if (c := cells.get(str(r))) else ""))  # fmt: skip
    return section("Whose queries calibrate a prompt's filters?", data, *blocks)
