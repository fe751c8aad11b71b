"""The needle in prose through the server, with the settings a user who changes nothing gets.

``auto`` (no eviction field), ``full`` and ``auto-small`` (``--max-kv-bytes`` of 2,048 tokens
and one request at a time, ``--max-batch 1``: the ``auto`` budget is then what that memory
holds, not a share of it);
``kvzip-small``: ``kv_method: kvzip`` at :data:`SMALL_KVZIP_BUDGET` rows without reuse on that
small server, where every prompt is compressed as it is read (what fits holds no whole prompt
and its pass);
``kvzip``: the same request on the default server, one pass over the whole prompt before the
answer (``qfilters_reuse: false``: a turn kept for reuse answers on its full cache instead);
``kvzap`` and ``kvzap-small``: ``kv_method: kvzap`` at the same budget on each server, every row
scored by the model's surrogate as it is written (no pass), the layers sharing the rows (kvzap's
default budget mode).
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

STUDY = "niah_served"
ARMS = ("auto", "full", "auto-small", "kvzip", "kvzip-small", "kvzap", "kvzap-small")
COLOURS = {
    "auto": "tab:blue",
    "full": "black",
    "auto-small": "tab:red",
    "kvzip": "goldenrod",
    "kvzip-small": "darkgoldenrod",
    "kvzap": "tab:green",
    "kvzap-small": "darkgreen",
}
SMALL_TOKENS = 2048  # the small server's --max-kv-bytes holds a full cache this long
SMALL_KVZIP_BUDGET = 256  # below the rows a prompt may hold there before it is compressed
KV_FIELDS = ("method", "budget", "budget_source", "evictions")  # kept of each kv_cache


def summarize(records: list[dict[str, Any]], lengths: list[int]) -> dict[str, dict[str, Any]]:
    """Per arm and length: accuracy, what ran (``method@budget`` where it evicted)."""
    out: dict[str, dict[str, Any]] = {arm: {} for arm in ARMS}
    for arm in ARMS:
        for n in lengths:
            if hits := [r for r in records if r["arm"] == arm and r["length"] == n]:
                ran = sorted(
                    {
                        f"{r['method']}@{r['budget']}" if r["evictions"] else r["method"]
                        for r in hits
                    }
                )
                out[arm][str(n)] = {
                    "accuracy": sum(r["correct"] for r in hits) / len(hits),
                    "n": len(hits),
                    "ran": ran,
                }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    run = start(
        STUDY,
        argv,
        __doc__,
        docs=(5, 2, "documents per length"),
        lengths=([1024, 2048, 4096, 8192], [256, 512]),
    )
    args = run.args
    from qfserve.engine.kv.memory import kv_row_bytes
    from qfserve.engine.serving.config import EngineConfig

    row = kv_row_bytes(run.model, run.loaded.config, EngineConfig().cache_defaults())
    small = row * (300 if args.quick else SMALL_TOKENS)
    # A quick run's small server reads 32-token chunks: a kvzip prompt then fits beside its pass.
    kvzip_budget, chunk = (
        (16, ["--prefill-chunk", "32"]) if args.quick else (SMALL_KVZIP_BUDGET, [])
    )
    logs = Path(tempfile.mkdtemp(prefix="niah-served-"))
    servers = [
        testing.start("qfserve", run.folder, log=logs / "default.log", timeout=300),
        testing.start(
            "qfserve",
            run.folder,
            "--max-kv-bytes",
            str(small),
            "--max-batch",
            "1",
            *chunk,
            log=logs / "small.log",
            timeout=300,
        ),
    ]
    kvzip = {"kv_method": "kvzip", "qfilters_budget": kvzip_budget, "qfilters_reuse": False}
    kvzap = {**kvzip, "kv_method": "kvzap"}
    bodies = {
        "full": {"kv_method": "full"},
        "kvzip": kvzip,
        "kvzip-small": kvzip,
        "kvzap": kvzap,
        "kvzap-small": kvzap,
    }

    def send(arm: str, doc: dict[str, Any]) -> dict[str, Any]:
        url = servers[arm.endswith("-small")].url
        correct, kv, _ = needle_answer(url, doc, bodies.get(arm, {}), 3600)
        return {"correct": correct, **{k: kv[k] for k in KV_FIELDS}}

    arms = with_surrogates(run, ARMS)
    try:
        records = needle_records(run, arms, args.lengths, args.docs, send)
    finally:
        testing.stop_all(servers, 15)
    accuracy = summarize(records, args.lengths)
    title = f"{run.identity['path']}: the needle with default settings"
    plot = lengths_plot(accuracy, args.lengths, args.out, STUDY, title, COLOURS)
    return run.save(
        {
            "docs": args.docs,
            "lengths": args.lengths,
            "small_kv_bytes": small,
            "small_tokens": small // row,
            "small_kvzip_budget": kvzip_budget,
            "accuracy": accuracy,
            "records": records,
            "plots": [plot],
        }
    )


def render(d: dict[str, Any]) -> list[str]:
    intro = (
        f"{d['docs']} documents per length, the needle at half depth; greedy. `auto`: "
        "no eviction field (`--budget auto`); `full`: `kv_method: full`; `auto-small`: "
        f"the same request on a server whose `--max-kv-bytes` holds {d['small_tokens']:,} "
        "tokens of full cache and runs one request at a time (`--max-batch 1`); `kvzip-small`: `kv_method: kvzip` at "
        f"{d.get('small_kvzip_budget', '?')} rows without reuse on that server, every prompt compressed "
        "as it is read; `kvzip`: the same on the default server without reuse, one pass "
        "over the whole prompt before the answer; `kvzap`, `kvzap-small`: `kv_method: kvzap` "
        "at the same budget on each server, rows scored by the model's surrogate as they are "
        "written and shared across layers (its default). Accuracy (what ran):"
    )
    rows = [
        [
            arm,
            *(
                f"{by[str(n)]['accuracy']:.2f} ({', '.join(by[str(n)]['ran'])})"
                if str(n) in by
                else "-"
                for n in d["lengths"]
            ),
        ]
        for arm, by in d["accuracy"].items()
    ]
    headers = ["arm", *[f"{n:,}" for n in d["lengths"]]]
    title = "The needle through the server with default settings"
    return section(title, d, intro, table(headers, rows))
