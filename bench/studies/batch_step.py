"""One decode step of a batch: our per-request caches against mlx-lm's batch cache.

``B`` prompts' Q-Filters caches in a :class:`~qfserve.engine.serving.batch.BatchCache` (also
chunked) against mlx-lm's ``BatchKVCache`` of the same rows: the model step and the cache
updates alone, interleaved (``ours_again`` = A/A).
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from bench.arms import make_caches, prefill
from bench.data import prompt_tokens
from bench.harness import (
    interleave,
    log2_axis,
    open_run,
    parse,
    parser,
    pyplot,
    ratio_row,
    save_plot,
    summaries,
)
from bench.report import plots, speed_header, table
from qfserve.engine.kv.attention import install_head_masks
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.serving.batch import BatchCache


def build(sm, B: int, prompt: int, budget: int, chunk: int):
    """(our per-layer batch caches, the same chunked, mlx-lm's) for ``B`` requests with
    different prompts."""
    model = sm.loaded.model
    config = CacheConfig(method="qfilters", budget=budget, recent=budget // 4)
    chunked_config = CacheConfig(method="qfilters", budget=budget, recent=budget // 4, chunk=chunk)
    ours, chunked, theirs = [], [], []
    base = prompt_tokens(sm, prompt * B)
    for b in range(B):
        tokens = mx.array([base[b * prompt : (b + 1) * prompt]])
        for mine, conf in ((ours, config), (chunked, chunked_config)):
            caches = make_caches(model, conf, filters=sm.filters)
            prefill(model, caches, tokens[0].tolist())
            mine.append(caches)
        plain = [KVCache() for _ in model.layers]
        model(tokens[:, -budget:], cache=plain)
        mx.eval([c.state for c in plain])
        theirs.append(plain)
    layers = range(len(model.layers))
    return (
        [BatchCache([ours[b][i] for b in range(B)]) for i in layers],
        [BatchCache([chunked[b][i] for b in range(B)]) for i in layers],
        [BatchKVCache.merge([theirs[b][i] for b in range(B)]) for i in layers],
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, reps=7, batches=([1, 4, 8, 16], [1, 2]), prompt=(512, 48, "tokens per "
               "prompt"), budget=(256, 16), chunk=(8, 4, "the chunked arm's"))  # fmt: skip
    args = parse(p, argv)
    batches, prompt, budget, chunk = args.batches, args.prompt, args.budget, args.chunk
    reps = args.reps
    sm = open_run("batch_step", args, argv)
    progress = sm.log
    model = sm.loaded.model
    install_head_masks(model)
    rows = []
    for B in batches:
        progress(f"batch {B}: prefilling {B} prompts of {prompt} tokens")
        ours, chunked, theirs = build(sm, B, prompt, budget, chunk)
        token = mx.array([[prompt_tokens(sm, 1)[0]]] * B)
        kv = mx.random.normal(
            ours[0].members[0].keys.shape[:2] + (1, ours[0].members[0].keys.shape[-1])
        )
        kv = mx.broadcast_to(kv, (B, *kv.shape[1:]))

        def step(caches, token=token):
            def run() -> float:
                tic = time.perf_counter()
                mx.eval(model(token, cache=caches))
                return time.perf_counter() - tic

            return run

        def updates(caches, kv=kv):
            def run() -> float:
                tic = time.perf_counter()
                mx.eval([c.update_and_fetch(kv, kv) for c in caches])
                return time.perf_counter() - tic

            return run

        arms = {
            "ours": step(ours),
            "theirs": step(theirs),
            "ours_chunked": step(chunked),
            "ours_again": step(ours),
            "ours_updates": updates(ours),
            "theirs_updates": updates(theirs),
        }
        runs = interleave(arms, reps, progress=progress.rounds(f"batch {B}"))
        rows.append(
            {
                "batch": B,
                "step_s": summaries(runs),
                "ratios": [
                    ratio_row(runs, "ours", "theirs"),
                    ratio_row(runs, "ours_again", "ours"),
                    ratio_row(runs, "ours_chunked", "ours"),
                ],
            }
        )
    one = (
        {a: rows[0]["step_s"][a]["median"] for a in ("ours", "theirs")} if batches[0] == 1 else None
    )
    for r in rows:
        if one:
            r["tokens_per_s_over_batch_1"] = {
                a: r["batch"] * one[a] / r["step_s"][a]["median"] for a in ("ours", "theirs")
            }
    result = {
        "study": "batch_step",
        "settings": {
            "batches": batches,
            "prompt": prompt,
            "budget": budget,
            "chunk": chunk,
            "reps": reps,
            "ours": "BatchCache over per-request Q-Filters EvictionCaches",
            "ours_chunked": f"the same with chunk {chunk}",
            "theirs": "mlx-lm BatchKVCache.merge of KVCaches with budget rows",
        },  # fmt: skip
        "rows": rows,
    }
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for a in ("ours", "theirs", "ours_updates", "theirs_updates"):
        ax.plot(batches, [r["step_s"][a]["median"] * 1e3 for r in rows], "o-", label=a)
    ax.set(title="one decode step (ms, median)", xlabel="batch size")
    log2_axis(ax, batches)
    ax.legend(fontsize=8)
    result["plots"] = [save_plot(fig, args.out, "batch_step")]
    return sm.save(result)


def render(d: dict[str, Any]) -> list[str]:
    """This study's section of ``bench/RESULTS.md``."""
    s = d["settings"]
    lines = speed_header("One decode step of a batch: per-request caches against mlx-lm's", d)
    lines.append(
        f"In process: {s['ours']} against {s['theirs']}; prompts of {s['prompt']} tokens, "
        f"budget {s['budget']}, {s['reps']} interleaved rounds (`ours_again` = A/A)."
        + (f" `ours_chunked`: {s['ours_chunked']}." if "ours_chunked" in s else "")
    )
    lines.append("")
    rows = []
    chunked = "ours_chunked" in s  # an arm added later: older results lack it
    for r in d["rows"]:
        ratio, aa, *more = r["ratios"]
        scale = r.get("tokens_per_s_over_batch_1", {})
        rows.append(
            [
                r["batch"],
                *(
                    f"{r['step_s'][a]['median'] * 1e3:.1f}"
                    for a in ("ours", "theirs", "ours_updates", "theirs_updates")
                ),  # fmt: skip
                f"{ratio['median']:.2f}",
                f"{aa['median']:.2f}",
                *([f"{more[0]['median']:.2f}"] if chunked else []),
                *(f"{scale[a]:.2f}×" if a in scale else "—" for a in ("ours", "theirs")),
            ]
        )
    headers = ["batch", "ours ms", "theirs ms", "ours updates ms", "theirs updates ms"]
    headers += ["ours/theirs", "A/A", *(["chunked/ours"] if chunked else [])]
    lines += table([*headers, "ours tok/s ×", "theirs tok/s ×"], rows)
    return lines + [*plots(d), ""]
