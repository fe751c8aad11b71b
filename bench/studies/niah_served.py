"""The needle in prose through the server, with the settings a user who changes nothing gets.

The ``niah`` documents (needle at half depth) sent to ``/v1/completions``: ``auto`` (no
eviction field), ``full`` (``kv_method: full``) and ``auto-small`` (a server whose
``--max-kv-bytes`` holds 2,048 tokens of full cache), each answer with what ``kv_cache`` said.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import httpx

from bench.data import stdlib_prose
from bench.harness import (
    append_jsonl,
    open_run,
    parse,
    parser,
    progress,
    resume,
    save_plot,
    subplots,
)
from bench.report import plots, quality_header, table
from bench.studies.niah import make_doc
from bench.studies.retrieval import first_number_is
from qfserve import testing

STUDY = "niah_served"
ARMS = ("auto", "full", "auto-small")
SMALL_TOKENS = 2048  # the small server's --max-kv-bytes holds a full cache this long


def ask(url: str, doc: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """One greedy answer and what its ``kv_cache`` says ran."""
    (card,) = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
    request = {"model": card["id"], "prompt": doc["prompt"], "max_tokens": len(doc["answer"]) + 2,
               "temperature": 0, **body}  # fmt: skip
    resp = httpx.post(f"{url}/v1/completions", json=request, timeout=3600)
    resp.raise_for_status()
    out = resp.json()
    kv = out["kv_cache"]
    return {"correct": first_number_is(out["choices"][0]["text"], doc["number"]),
            **{k: kv[k] for k in ("method", "budget", "budget_source", "evictions")}}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, docs=(5, 2, "documents per length"),
               lengths=([1024, 2048, 4096, 8192], [256, 512]))  # fmt: skip
    args = parse(p, argv)
    docs, lengths = args.docs, args.lengths
    run = open_run(STUDY, args, argv)
    from qfserve.engine.serving.admission import kv_row_bytes
    from qfserve.engine.serving.config import EngineConfig

    row = kv_row_bytes(run.model, run.loaded.config, EngineConfig().cache_defaults())
    small = row * (300 if args.quick else SMALL_TOKENS)
    log = args.out / f"{STUDY}.jsonl"
    done = resume(log, lambda r: (r["arm"], r["length"], r["doc"]), fresh=args.quick)
    paragraphs = list(stdlib_prose())
    logs = Path(tempfile.mkdtemp(prefix="niah-served-"))
    servers = [
        testing.start("qfserve", run.folder, log=logs / "default.log", timeout=300),
        testing.start("qfserve", run.folder, "--max-kv-bytes", str(small),
                      log=logs / "small.log", timeout=300),
    ]  # fmt: skip
    todo = [(a, n, d) for n in lengths for d in range(docs) for a in ARMS]
    room = run.context_length - 16  # the prompt and its answer fit (8k: 8,176 tokens at most)
    try:
        with progress(total=len(todo), desc="answers") as bar:
            for arm, n, d in todo:
                if (arm, n, d) not in done:
                    doc = make_doc(run.tokenizer, paragraphs, min(n, room), 0.5, d)
                    url = servers[arm == "auto-small"].url
                    rec = {"arm": arm, "length": n, "doc": d, "tokens": doc["tokens"],
                           **ask(url, doc, {"kv_method": "full"} if arm == "full" else {})}  # fmt: skip
                    append_jsonl(log, rec)
                    done[(arm, n, d)] = rec
                bar.update(1)
    finally:
        testing.stop_all(servers, 15)
    records = [done[k] for k in todo]
    accuracy = summarize(records, lengths)
    fig, ax = subplots()
    for arm, colour in zip(ARMS, ("tab:blue", "black", "tab:red"), strict=True):
        xs = [n for n in lengths if str(n) in accuracy[arm]]
        ax[0, 0].plot(xs, [accuracy[arm][str(n)]["accuracy"] for n in xs], marker="o",
                      color=colour, label=arm)  # fmt: skip
    ax[0, 0].set(xscale="log", xlabel="prompt tokens", ylabel="accuracy", ylim=(-0.05, 1.05))
    ax[0, 0].legend(fontsize=7)
    save_plot(fig, args.out, STUDY, f"{run.identity['path']}: the needle with default settings")
    return run.save({"docs": docs, "lengths": lengths, "small_kv_bytes": small,
                     "small_tokens": small // row, "accuracy": accuracy, "records": records,
                     "plots": [f"{STUDY}.png"]})  # fmt: skip


def summarize(records: list[dict[str, Any]], lengths: list[int]) -> dict[str, dict[str, Any]]:
    """Per arm and length: accuracy, what ran (``method@budget`` where it evicted)."""
    out: dict[str, dict[str, Any]] = {arm: {} for arm in ARMS}
    for arm in ARMS:
        for n in lengths:
            hits = [r for r in records if r["arm"] == arm and r["length"] == n]
            if hits:
                ran = sorted({f"{r['method']}@{r['budget']}" if r["evictions"] else r["method"]
                              for r in hits})  # fmt: skip
                out[arm][str(n)] = {"accuracy": sum(r["correct"] for r in hits) / len(hits),
                                    "n": len(hits), "ran": ran}  # fmt: skip
    return out


def render(d: dict[str, Any]) -> list[str]:
    """This study's section of ``bench/RESULTS.md``."""
    lines = quality_header("The needle through the server with default settings", d)
    lines += ["", f"{d['docs']} documents per length, the needle at half depth; greedy. `auto`: "
              "no eviction field (`--budget auto`); `full`: `kv_method: full`; `auto-small`: "
              f"the same request on a server whose `--max-kv-bytes` holds {d['small_tokens']:,} "
              "tokens of full cache. Accuracy (what ran):", ""]  # fmt: skip
    lines += table(["arm", *[f"{n:,}" for n in d["lengths"]]], [
        [arm, *(f"{by[str(n)]['accuracy']:.2f} ({', '.join(by[str(n)]['ran'])})"
                if str(n) in by else "-" for n in d["lengths"])]
        for arm, by in d["accuracy"].items()])  # fmt: skip
    return lines + plots(d)
