"""Study 6: decode ms/step against context, eviction overhead, kept KV and memory.

Three parts, each with its arms interleaved in one process:

1. **Context sweep**: at each context (``--contexts``, default 1,024 doubling to the model's
   trained length), a full cache holding the context (twice: the A/A pair) against Q-Filters
   at each budget (``--budgets``, default 128-1,024). Full caches are trimmed back one row
   after every step so they stay at the context.
2. **Eviction overhead at equal size**: our cache at budget B holding B rows and evicting one
   per step, against mlx-lm's ``KVCache`` holding B rows (twice, A/A).
3. **Memory**, measured while part 1 builds its arms, one arm at a time (memory is not a
   timing): kept KV bytes, the bytes the cache arrays hold, MLX's peak memory above what was
   live before the arm during its prefill (512-token chunks, as the server prefills) and its
   first decode steps, and how much the process's RSS grew for the arm (after
   ``mx.clear_cache()``; the allocator may keep freed pages, so RSS is an upper bound).

Each arm is prefilled once, the way the server prefills, and then both measured for memory
and timed; the A/A full arm is a copy of the first one's rows.

Run: ``python -m bench.speed.decode [--quick] [--model M] [--reps 5] [--steps 16]``.
Writes ``bench/results/<model>/decode.json`` and ``decode_ms.png``, ``decode_memory.png``.
"""

from __future__ import annotations

from qfserve.engine.models.blas import reexec_with_openblas

reexec_with_openblas()

from typing import Any  # noqa: E402

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from bench.cli import command_line, parse, parser  # noqa: E402
from bench.harness import (  # noqa: E402
    interleave,
    print_table,
    ratio_row,
    summary,
    write_results,
)
from bench.speed import common  # noqa: E402

BUDGETS = (128, 256, 512, 1024)


def contexts_for(max_context: int, quick: bool) -> list[int]:
    """1,024 doubling up to the model's trained length (which is always included)."""
    if quick:
        return [128, 256]
    out, c = [], 1024
    while c < max_context:
        out.append(c)
        c *= 2
    return [*out, max_context]


def rss_bytes() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def copy_full(model, caches: list[Any]) -> list[Any]:
    """A fresh full cache holding the same rows (new arrays: nothing shared)."""
    out = make_prompt_cache(model)
    for dst, src in zip(out, caches, strict=True):
        n = src.offset
        dst.update_and_fetch(mx.array(src.keys[..., :n, :]), mx.array(src.values[..., :n, :]))
    mx.eval([c.state for c in out])
    return out


def build_arm(sm, arm: str | int, tokens: list[int], steps: int) -> tuple[list[Any], dict]:
    """Prefill one arm's caches as the server would; its memory figures on the way."""
    model = sm.loaded.model
    mx.clear_cache()
    base, rss0 = mx.get_active_memory(), rss_bytes()
    mx.reset_peak_memory()
    caches = common.caches_for(sm, arm)
    common.prefill(model, caches, tokens)
    prefill_peak = mx.get_peak_memory() - base
    mx.reset_peak_memory()
    common.decode_timer(model, caches, steps, hold=True)()  # also the arm's warm-up
    decode_peak = mx.get_peak_memory() - base
    mx.clear_cache()
    return caches, {
        **common.kv_stats(caches),
        "prefill_peak_bytes": prefill_peak,
        "decode_peak_bytes": decode_peak,
        "rss_growth_bytes": rss_bytes() - rss0,
    }


def sweep(sm, contexts, budgets, reps, steps, progress) -> tuple[list[dict], list[dict]]:
    model = sm.loaded.model
    rows, memory = [], []
    for context in contexts:
        tokens = common.prompt_tokens(sm, context)
        arms, caches = {}, {}
        for name, arm in [("full_a", "full"), *((f"b{b}", b) for b in budgets)]:
            progress(f"context {context}: prefilling {name}")
            caches[name], mem = build_arm(sm, arm, tokens, steps)
            memory.append({"context": context, "arm": "full" if arm == "full" else name, **mem})
            arms[name] = common.decode_timer(model, caches[name], steps, hold=True)
            if name == "full_a":
                caches["full_b"] = copy_full(model, caches["full_a"])
                arms["full_b"] = common.decode_timer(model, caches["full_b"], steps, hold=True)
        samples = interleave(arms, reps, progress=progress.rounds(f"context {context}"))
        rows.append(
            {
                "context": context,
                "beyond_trained_context": context > sm.context_length,
                "ms_per_step": {k: summary(v) for k, v in samples.items()},
                "ratios": [ratio_row(samples, "full_b", "full_a")]
                + [ratio_row(samples, f"b{b}", "full_a") for b in budgets],
                # The first decode step takes a cache at its budget over it: from then on it evicts.
                "evicting": {f"b{b}": context >= b for b in budgets},
            }
        )
        del arms, caches
    return rows, memory


def overhead(sm, budgets, reps, steps, progress) -> list[dict]:
    model = sm.loaded.model
    rows = []
    for b in budgets:
        progress(f"equal size {b}: prefilling")
        tokens = common.prompt_tokens(sm, 2 * b)
        arms = {}
        for name in ("kvcache_a", "kvcache_b"):
            caches = make_prompt_cache(model)
            common.prefill(model, caches, tokens[:b])
            arms[name] = common.decode_timer(model, caches, steps, hold=True)
        ours = common.caches_for(sm, b)
        common.prefill(model, ours, tokens)  # 2B tokens: every decode step evicts one row
        arms["ours"] = common.decode_timer(model, ours, steps, hold=False)
        samples = interleave(arms, reps, progress=progress.rounds(f"equal size {b}"))
        rows.append(
            {
                "budget": b,
                "ms_per_step": {k: summary(v) for k, v in samples.items()},
                "ratios": [
                    ratio_row(samples, "kvcache_b", "kvcache_a"),
                    ratio_row(samples, "ours", "kvcache_a"),
                ],
            }
        )
    return rows


def plot(result, out) -> list[str]:
    plt = common.plt()
    budgets = result["settings"]["budgets"]
    ctx = [r["context"] for r in result["sweep"]]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for arm, label in [("full_a", "full"), *((f"b{b}", f"Q-Filters budget {b}") for b in budgets)]:
        med, err = common.errorbars([r["ms_per_step"][arm] for r in result["sweep"]])
        ax.errorbar(ctx, med, yerr=err, marker="o", capsize=3, label=label)
    trained = result["model"]["max_context"]
    ax.axvline(trained, color="grey", ls=":", label=f"trained context {trained}")
    ax.set(
        xlabel="context (tokens)",
        ylabel="ms / decode step (median, IQR)",
        title="Decode step time vs context",
    )
    common.log2_axis(ax, ctx)
    ax.legend()
    names = [common.save_figure(fig, out, "decode_ms")]

    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = [
        ("kept_bytes", "Kept KV bytes (all layers)"),
        ("peak_bytes", "MLX peak above weights (prefill or decode)"),
        ("rss_growth_bytes", "Process RSS growth for the arm"),
    ]
    for arm in ("full", *(f"b{b}" for b in budgets)):
        rows = [r for r in result["memory"] if r["arm"] == arm]
        x = [r["context"] for r in rows]
        for a, (key, _) in zip(axes, panels, strict=True):
            y = [
                max(r["prefill_peak_bytes"], r["decode_peak_bytes"]) if key == "peak_bytes"
                else r[key]
                for r in rows
            ]  # fmt: skip
            a.plot(x, [max(v, 0) / 2**20 for v in y], marker="o", label=arm)
    for a, (_, title) in zip(axes, panels, strict=True):
        a.set(xlabel="context (tokens)", ylabel="MiB", title=title)
        common.log2_axis(a, ctx)
        a.legend()
    names.append(common.save_figure(fig, out, "decode_memory"))
    return names


def main(argv=None) -> dict:
    args_p = parser(__doc__.splitlines()[0], reps=5)
    args_p.add_argument("--steps", type=int, default=None, help="decode steps per timing (16)")
    args_p.add_argument("--contexts", type=int, nargs="+", default=None, help="context tokens")
    args_p.add_argument("--budgets", type=int, nargs="+", default=None, help="Q-Filters budgets")
    args = parse(args_p, argv)
    reps = args.reps
    steps = args.steps or (4 if args.quick else 16)
    progress = common.Progress("decode")
    sm = common.load_study_model(args.model)
    contexts = args.contexts or contexts_for(sm.context_length, args.quick)
    budgets = tuple(args.budgets or ((64, 128) if args.quick else BUDGETS))
    progress(f"model {sm.loaded.name}, contexts {contexts}, budgets {budgets}, reps {reps}")
    rows, memory = sweep(sm, contexts, budgets, reps, steps, progress)
    full = next(m for m in memory if m["arm"] == "full")

    result = {
        "study": 6,
        "command": command_line("bench.speed.decode", argv),
        "quick": args.quick,
        "model": sm.describe(),
        "settings": {
            "reps": reps,
            "steps": steps,
            "budgets": list(budgets),
            "n_sink": 4,
            "recent": 0,
            "method": "qfilters",
            "prefill_chunk": 512,
        },
        "kv_bytes_per_token": full["kept_bytes"] / full["tokens_kept"],
        "sweep": rows,
        "overhead": overhead(sm, budgets, reps, steps, progress),
        "memory": memory,
        "runtime_s": None,
    }
    result["plots"] = plot(result, args.out)
    result["runtime_s"] = round(progress.elapsed, 1)
    path = write_results("decode", result, args.out, section="speed")

    print("\nDecode ms/step (median [IQR]) and ratio to full (median of paired ratios)")
    rows = []
    for r in result["sweep"]:
        ms = r["ms_per_step"]
        label = f"{r['context']}" + (" (beyond trained)" if r["beyond_trained_context"] else "")
        rr = {x["arm"]: x for x in r["ratios"]}
        rows.append(
            [
                label,
                f"{ms['full_a']['median']:.2f}",
                f"{rr['full_b']['median']:.3f} [{rr['full_b']['q1']:.2f}-{rr['full_b']['q3']:.2f}]",
                *(f"{ms[f'b{b}']['median']:.2f} ({rr[f'b{b}']['median']:.3f})" for b in budgets),
            ]
        )
    print_table(["context", "full ms", "A/A ratio", *(f"b{b} ms (ratio)" for b in budgets)], rows)
    print("\nEviction overhead at equal size (ours at B holding B rows / KVCache holding B rows)")
    print_table(
        ["budget", "A/A", "ours/KVCache", "q1-q3"],
        [
            [
                o["budget"],
                f"{o['ratios'][0]['median']:.3f}",
                f"{o['ratios'][1]['median']:.3f}",
                f"{o['ratios'][1]['q1']:.3f}-{o['ratios'][1]['q3']:.3f}",
            ]
            for o in result["overhead"]
        ],
    )
    print(f"\nMemory (MiB); KV bytes per token (full cache): {result['kv_bytes_per_token']:,.0f}")
    print_table(
        ["context", "arm", "kept KV", "cache arrays", "prefill peak", "decode peak", "RSS growth"],
        [
            [
                m["context"],
                m["arm"],
                m["kept_bytes"] / 2**20,
                m["cache_nbytes"] / 2**20,
                m["prefill_peak_bytes"] / 2**20,
                m["decode_peak_bytes"] / 2**20,
                m["rss_growth_bytes"] / 2**20,
            ]
            for m in result["memory"]
        ],
    )
    print(f"\nwrote {path} in {result['runtime_s']}s")
    return result


if __name__ == "__main__":
    main()
