"""The needle in prose through the server, with the settings a user who changes nothing gets.

Same documents as :mod:`bench.quality.niah` (a 7-digit number stated once in standard-library
prose, asked for at the end), sent as token ids to ``/v1/completions``, greedy. Arms:

- ``auto``: the default server, the request sends no eviction field (``--budget auto``);
- ``full``: the same server, ``kv_method: full`` (the reference);
- ``auto-small``: a server started with a small ``--max-kv-bytes`` (by default what a full
  cache of 2,048 tokens holds), the request again sending nothing: past what fits, it evicts.

Each answer records what ``kv_cache`` reported (method, budget, ``budget_source``,
evictions). Results are appended to ``<out>/niah_served.jsonl`` one answer at a time (an
interrupted run resumes); ``niah_served.json`` and a plot are written at the end.

Run: ``python -m bench.quality.niah_served [--quick] [--docs N] [--lengths ...]``.
"""

from __future__ import annotations

import json
import re
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench.cli import parse, parser
from bench.harness import print_table, write_results
from bench.models import load
from bench.quality import plots
from bench.quality.niah import make_doc
from bench.quality.prose import stdlib_prose
from bench.servers import start, stop_all

STUDY = "niah_served"
ARMS = ("auto", "full", "auto-small")
SMALL_TOKENS = 2048  # the small server's --max-kv-bytes holds a full cache this long


def ask(url: str, doc: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    (card,) = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    request = {
        "model": card["id"],
        "prompt": doc["prompt"],
        "max_tokens": len(doc["answer"]) + 2,
        "temperature": 0,
        **body,
    }
    resp = httpx.post(f"{url}/v1/completions", json=request, timeout=3600)
    resp.raise_for_status()
    out = resp.json()
    found = re.search(r"\d+", out["choices"][0]["text"])
    kv = out["kv_cache"]
    return {
        "correct": bool(found and found.group() == doc["number"]),
        **{k: kv[k] for k in ("method", "budget", "budget_source", "evictions", "tokens_kept")},
    }


def main(argv: list[str] | None = None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--docs", type=int, default=None, help="documents per length (default 5)")
    p.add_argument("--lengths", type=int, nargs="+", default=None)
    p.add_argument("--small-kv-bytes", type=int, default=None)
    started = time.perf_counter()
    args = parse(p, argv)
    ref, out = args.model, args.out
    docs = args.docs or (2 if args.quick else 5)
    lengths = args.lengths or ([256, 512] if args.quick else [1024, 2048, 4096, 8192])
    model = load(ref)
    tokenizer = model.tokenizer
    from qfserve.engine.serving.admission import kv_row_bytes
    from qfserve.engine.serving.config import EngineConfig

    template = EngineConfig().cache_defaults()
    row = kv_row_bytes(model.loaded.model, model.loaded.config, template)
    small_tokens = 300 if args.quick else SMALL_TOKENS
    small = args.small_kv_bytes or row * small_tokens
    paragraphs = list(stdlib_prose())
    jsonl = out / f"{STUDY}.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    done = {
        (r["arm"], r["length"], r["doc"])
        for r in (json.loads(line) for line in jsonl.read_text().splitlines() if line.strip())
    } if jsonl.exists() else set()  # fmt: skip
    logs = Path(tempfile.mkdtemp(prefix="niah-served-"))
    servers = [
        start("qfserve", str(model.folder), log=logs / "default.log", timeout=300),
        start(
            "qfserve",
            str(model.folder),
            "--max-kv-bytes",
            str(small),
            log=logs / "small.log",
            timeout=300,
        ),
    ]
    try:
        for length in lengths:
            for index in range(docs):
                doc = make_doc(tokenizer, paragraphs, length, 0.5, index)
                for arm in ARMS:
                    if (arm, length, index) in done:
                        continue
                    url = servers[1 if arm == "auto-small" else 0].url
                    body = {"kv_method": "full"} if arm == "full" else {}
                    row_out = {"arm": arm, "length": length, "doc": index, **ask(url, doc, body)}
                    row_out["tokens"] = doc["tokens"]
                    with jsonl.open("a") as f:
                        f.write(json.dumps(row_out) + "\n")
                    print(json.dumps(row_out), flush=True)
    finally:
        stop_all(servers, 15)
    rows = [json.loads(line) for line in jsonl.read_text().splitlines() if line.strip()]
    table = summarize(rows, lengths)
    print_table(
        ["arm", *[str(n) for n in lengths]],
        [[arm, *[table[arm].get(str(n), {}).get("label", "-") for n in lengths]] for arm in ARMS],
        title=f"needle through the server, {docs} documents per length: accuracy (method)",
    )
    write_results(
        STUDY,
        {
            "study": STUDY,
            "model": ref,
            "docs": docs,
            "lengths": lengths,
            "small_kv_bytes": small,
            "small_tokens": small // row,
            "accuracy": table,
        },
        out,
        section="quality",
        started=started,
    )
    plot(table, lengths, out)
    return 0


def summarize(rows: list[dict[str, Any]], lengths: list[int]) -> dict[str, dict[str, Any]]:
    """Per arm and length: accuracy, the methods that ran and whether anything was evicted."""
    table: dict[str, dict[str, Any]] = {}
    for arm in ARMS:
        for n in lengths:
            hits = [r for r in rows if r["arm"] == arm and r["length"] == n]
            if not hits:
                continue
            acc = sum(r["correct"] for r in hits) / len(hits)
            methods = sorted({f"{r['method']}@{r['budget']}" if r["evictions"] else r["method"]
                              for r in hits})  # fmt: skip
            table.setdefault(arm, {})[str(n)] = {
                "accuracy": acc,
                "n": len(hits),
                "methods": methods,
                "evicted": sum(bool(r["evictions"]) for r in hits),
                "label": f"{acc:.2f} ({', '.join(methods)})",
            }
    return table


def plot(table: dict[str, dict[str, Any]], lengths: list[int], out: Path) -> None:
    fig, axes = plots.subplots()
    ax = axes[0][0]
    styles = {"auto": ("tab:blue", "o"), "full": ("black", "s"), "auto-small": ("tab:red", "^")}
    for arm in ARMS:
        xs = [n for n in lengths if str(n) in table.get(arm, {})]
        ys = [table[arm][str(n)]["accuracy"] for n in xs]
        colour, marker = styles[arm]
        ax.plot(xs, ys, marker=marker, color=colour, label=arm)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("needle accuracy")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(fontsize=8)
    plots.save(fig, out, STUDY, "needle through the server with default settings")


if __name__ == "__main__":
    sys.exit(main())
