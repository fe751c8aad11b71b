"""The needle and KV bytes at long context through the server, for models whose layers mix
sliding windows and global attention (Gemma 3: five layers of six see the last 512 tokens).

Only the global layers grow with the prompt, so only they evict; the sliding layers' windows
count in every arm's bytes (``kv_cache``'s ``window_bytes``). Arms: ``full``; ``<method>-<r>x``,
``kv_method`` at ``qfilters_budget`` = prompt tokens / r on the global layers, without reuse
(so kvzip compresses before it answers); the kvzap arms run where the model has surrogates. Per prompt: the needle answered or not, and
``kept_bytes`` / ``full_seq_bytes`` as the server reports them.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from bench.clients import needle_answer, needle_records, with_surrogates
from bench.plots import lengths_plot
from bench.report import section, table
from bench.run import start
from qfserve import testing

STUDY = "long_context"
ARMS = (
    "full",
    "qfilters-4x",
    "kvzip-4x",
    "kvzap-4x",
    "streaming-4x",
    "qfilters-8x",
    "kvzip-8x",
    "kvzap-8x",
)
COLOURS = {
    "full": "black",
    "qfilters-4x": "tab:blue",
    "kvzip-4x": "goldenrod",
    "streaming-4x": "tab:grey",
    "qfilters-8x": "tab:cyan",
    "kvzip-8x": "darkgoldenrod",
    "kvzap-4x": "tab:green",
    "kvzap-8x": "darkgreen",
}
KV_FIELDS = (  # what each record keeps of the response's kv_cache
    "method",
    "budget",
    "tokens_kept",
    "kept_bytes",
    "full_seq_bytes",
    "window_bytes",
    "evicting_layers",
    "window_layers",
)


def body(arm: str, tokens: int) -> dict[str, Any]:
    """The request's eviction fields for ``arm`` on a prompt of ``tokens``."""
    if arm == "full":
        return {"kv_method": "full"}
    method, ratio = arm.rsplit("-", 1)
    budget = max(64, tokens // int(ratio.rstrip("x")))
    return {"kv_method": method, "qfilters_budget": budget, "qfilters_reuse": False}


def summarize(records: list[dict[str, Any]], lengths: list[int]) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {}
    for arm in ARMS:
        for n in lengths:
            hits = [r for r in records if r["arm"] == arm and r["length"] == n]
            if not hits:
                continue
            kept = sum(r["kept_bytes"] for r in hits) / len(hits)
            full = sum(r["full_seq_bytes"] for r in hits) / len(hits)
            out.setdefault(arm, {})[str(n)] = {
                "accuracy": sum(r["correct"] for r in hits) / len(hits),
                "n": len(hits),
                "kept_mib": kept / 2**20,
                "full_mib": full / 2**20,
                "bytes_ratio": kept / full if full else 1.0,
                "window_mib": hits[0]["window_bytes"] / 2**20,
                "seconds": sum(r["seconds"] for r in hits) / len(hits),
            }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    run = start(
        STUDY,
        argv,
        __doc__,
        docs=(2, 1, "documents per length"),
        lengths=([2048, 4096, 8192, 16384, 32768], [256, 512]),
        flags={
            "--arms": {
                "nargs": "+",
                "default": list(ARMS),
                "choices": ARMS,
                "help": "arms to run (default: all)",
            }
        },
    )
    args = run.args
    logs = Path(tempfile.mkdtemp(prefix="long-context-"))
    server = testing.start("qfserve", run.folder, log=logs / "server.log", timeout=600)

    def send(arm: str, doc: dict[str, Any]) -> dict[str, Any]:
        correct, kv, seconds = needle_answer(server.url, doc, body(arm, doc["tokens"]), 7200)
        return {"correct": correct, "seconds": seconds, **{k: kv[k] for k in KV_FIELDS}}

    arms = with_surrogates(run, args.arms)
    try:
        records = needle_records(run, arms, args.lengths, args.docs, send)
    finally:
        testing.stop_all([server], 15)
    results = summarize(records, args.lengths)
    title = f"{run.identity['path']}: the needle at long context"
    plot = lengths_plot(results, args.lengths, args.out, STUDY, title, COLOURS)
    return run.save(
        {
            "docs": args.docs,
            "lengths": args.lengths,
            "arms": arms,
            "results": results,
            "records": records,
            "plots": [plot],
        }
    )


def render(d: dict[str, Any]) -> list[str]:
    intro = (
        f"{d['docs']} document(s) per length, the needle at half depth, greedy, through "
        "`/v1/completions`; `<method>-<r>x`: `qfilters_budget` = prompt tokens / r on the "
        "global layers, `qfilters_reuse: false`. Each cell: needle accuracy, then KV "
        "bytes kept / the full cache's (sliding-window layers counted in both)."
    )
    lengths = d["lengths"]
    rows = []
    for arm, by in d["results"].items():
        cells = []
        for n in lengths:
            c = by.get(str(n))
            cells.append(
                "-"
                if c is None
                else f"{c['accuracy']:.2f} · {c['kept_mib']:.1f}/{c['full_mib']:.1f} MiB "
                f"({c['bytes_ratio']:.2f})"
            )
        rows.append([arm, *cells])
    return section(
        "The needle and KV bytes at long context",
        d,
        intro,
        table(["arm", *[f"{n:,}" for n in lengths]], rows),
    )
