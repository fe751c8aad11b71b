"""One decode step of a batch: ``B`` prompts' Q-Filters caches in a
:class:`~qfserve.engine.kv.batch.BatchCache` (also chunked) against mlx-lm's
``BatchKVCache`` of the same rows; the model step and the cache updates alone, interleaved."""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

from bench.arms import make_caches, prefill
from bench.data import prompt_tokens
from bench.plots import log2_axis, save_plot, subplots
from bench.report import section, table
from bench.run import start
from bench.timing import interleave, ratio_row, summaries, timed
from qfserve.engine.kv.attention import install_head_masks
from qfserve.engine.kv.batch import BatchCache
from qfserve.engine.kv.config import CacheConfig

PLOTTED = ("ours", "theirs", "ours_updates", "theirs_updates")


def build(sm, B: int, prompt: int, budget: int, chunk: int) -> tuple[list, ...]:
    """Per layer: our batch caches of ``B`` different prompts, the same chunked, mlx-lm's."""
    base, requests = prompt_tokens(sm, prompt * B), []
    for b in range(B):
        tokens = base[b * prompt : (b + 1) * prompt]
        configs = [
            CacheConfig(method="qfilters", budget=budget, recent=budget // 4, chunk=c)
            for c in (1, chunk)
        ]
        ours = [make_caches(sm.model, config, filters=sm.filters) for config in configs]
        for caches in ours:
            prefill(sm.model, caches, tokens)
        plain = [KVCache() for _ in sm.model.layers]
        sm.model(mx.array([tokens[-budget:]]), cache=plain)
        mx.eval([c.state for c in plain])
        requests.append((*ours, plain))
    layers = range(len(sm.model.layers))
    kinds = (BatchCache, BatchCache, BatchKVCache.merge)
    return tuple(
        [make([r[k][i] for r in requests]) for i in layers] for k, make in enumerate(kinds)
    )


def measure(sm, B: int) -> dict[str, Any]:
    """One batch size's row: the model step on each batch cache, and their updates alone."""
    a = sm.args
    sm.log(f"batch {B}: prefilling {B} prompts of {a.prompt} tokens")
    ours, chunked, theirs = build(sm, B, a.prompt, a.budget, a.chunk)
    token = mx.array([[prompt_tokens(sm, 1)[0]]] * B)
    shape = ours[0].members[0].keys.shape
    kv = mx.broadcast_to(mx.random.normal((*shape[:2], 1, shape[-1])), (B, shape[1], 1, shape[-1]))

    def step(caches: list[Any]) -> Any:
        return timed(lambda: sm.model(token, cache=caches))

    def updates(caches: list[Any]) -> Any:
        return timed(lambda: [c.update_and_fetch(kv, kv) for c in caches])

    arms = {
        "ours": step(ours),
        "theirs": step(theirs),
        "ours_chunked": step(chunked),
        "ours_again": step(ours),
        "ours_updates": updates(ours),
        "theirs_updates": updates(theirs),
    }
    runs = interleave(arms, a.reps, progress=sm.log.rounds(f"batch {B}"))
    pairs = (("ours", "theirs"), ("ours_again", "ours"), ("ours_chunked", "ours"))
    return {"batch": B, "step_s": summaries(runs), "ratios": [ratio_row(runs, *p) for p in pairs]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    sm = start(
        "batch_step",
        argv,
        __doc__,
        reps=7,
        batches=([1, 4, 8, 16], [1, 2]),
        prompt=(512, 48, "tokens per prompt"),
        budget=(256, 16),
        chunk=(8, 4, "the chunked arm's"),
    )
    args = sm.args
    install_head_masks(sm.model)
    rows = [measure(sm, B) for B in args.batches]
    if args.batches[0] == 1:
        one = {a: rows[0]["step_s"][a]["median"] for a in ("ours", "theirs")}
        for r in rows:
            r["tokens_per_s_over_batch_1"] = {
                a: r["batch"] * one[a] / r["step_s"][a]["median"] for a in one
            }
    result = {
        "settings": {
            "batches": args.batches,
            "prompt": args.prompt,
            "budget": args.budget,
            "chunk": args.chunk,
            "reps": args.reps,
            "ours": "BatchCache over per-request Q-Filters EvictionCaches",
            "ours_chunked": f"the same with chunk {args.chunk}",
            "theirs": "mlx-lm BatchKVCache.merge of KVCaches with budget rows",
        },
        "rows": rows,
    }
    fig, [[ax]] = subplots(figsize=(6, 3.8))
    for a in PLOTTED:
        ax.plot(args.batches, [r["step_s"][a]["median"] * 1e3 for r in rows], "o-", label=a)
    ax.set(title="one decode step (ms, median)", xlabel="batch size")
    log2_axis(ax, args.batches)
    ax.legend(fontsize=8)
    result["plots"] = [save_plot(fig, args.out, "batch_step")]
    return sm.save(result)


def render(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    intro = (
        f"In process: {s['ours']} against {s['theirs']}; prompts of {s['prompt']} tokens, "
        f"budget {s['budget']}, {s['reps']} interleaved rounds (`ours_again` = A/A). "
        f"`ours_chunked`: {s['ours_chunked']}."
    )
    rows = []
    for r in d["rows"]:
        scale = r.get("tokens_per_s_over_batch_1", {})  # only when batch 1 ran
        rows.append(
            [
                r["batch"],
                *(f"{r['step_s'][a]['median'] * 1e3:.1f}" for a in PLOTTED),
                *(f"{x['median']:.2f}" for x in r["ratios"]),
                *(f"{scale[a]:.2f}×" if a in scale else "—" for a in ("ours", "theirs")),
            ]
        )
    headers = ["batch", "ours ms", "theirs ms", "ours updates ms", "theirs updates ms"]
    headers += ["ours/theirs", "A/A", "chunked/ours", "ours tok/s ×", "theirs tok/s ×"]
    title = "One decode step of a batch: per-request caches against mlx-lm's"
    return section(title, d, intro, table(headers, rows))
