"""Study 6: decode ms/step against context, eviction overhead, kept KV and peak memory.

Three parts, each with its arms interleaved in one process:

1. **Context sweep**: at each context (256 up to the model's maximum, plus 2x beyond it,
   labelled, since RoPE runs past the trained length), a full cache holding the context
   (twice: the A/A pair) against Q-Filters at budgets 256 and 512. Full caches are trimmed
   back one row after every step so they stay at the context.
2. **Eviction overhead at equal size**: our cache at budget B holding B rows and evicting one
   per step, against mlx-lm's ``KVCache`` holding B rows (twice, A/A).
3. **Memory**: per context and arm, kept KV bytes, the bytes the cache arrays hold, and MLX's
   peak memory above the weights during prefill and during decode (``mx.reset_peak_memory``
   between them). Run one arm at a time: memory is not a timing and needs no interleaving.

Run: ``python -m bench.speed.decode [--quick] [--model DIR] [--reps 7] [--steps 32]``.
Writes ``bench/results/decode.json`` and ``decode_ms.png``, ``decode_memory.png``.
"""

from __future__ import annotations

from engine.blas import reexec_with_openblas

reexec_with_openblas()

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from bench.harness import interleave, ratio_row, summary, write_json  # noqa: E402
from bench.speed import common  # noqa: E402

BUDGETS = (256, 512)


def contexts_for(max_context: int, quick: bool) -> list[tuple[int, bool]]:
    """(context, beyond the trained length) from 256 doubling to the maximum, then 2x it."""
    if quick:
        return [(128, False), (256, False)]
    out, c = [], 256
    while c < max_context:
        out.append((c, False))
        c *= 2
    return [*out, (max_context, False), (2 * max_context, True)]


def sweep(sm, contexts, budgets, reps, steps, progress) -> list[dict]:
    model = sm.loaded.model
    rows = []
    for context, beyond in contexts:
        tokens = common.prompt_tokens(sm, context)
        progress(f"context {context}: prefilling {2 + len(budgets)} arms")
        arms = {}
        for name, arm in [("full_a", "full"), ("full_b", "full"), *((f"b{b}", b) for b in budgets)]:
            caches = common.caches_for(sm, arm)
            common.prefill(model, caches, tokens)
            arms[name] = common.decode_timer(model, caches, steps, hold=True)
        samples = interleave(arms, reps, progress=progress.rounds(f"context {context}"))
        rows.append(
            {
                "context": context,
                "beyond_trained_context": beyond,
                "ms_per_step": {k: summary(v) for k, v in samples.items()},
                "ratios": [ratio_row(samples, "full_b", "full_a")]
                + [ratio_row(samples, f"b{b}", "full_a") for b in budgets],
                # The first decode step takes a cache at its budget over it: from then on it evicts.
                "evicting": {f"b{b}": context >= b for b in budgets},
            }
        )
    return rows


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


def memory(sm, contexts, budgets, steps, progress) -> list[dict]:
    model = sm.loaded.model
    rows = []
    for context, beyond in contexts:
        tokens = common.prompt_tokens(sm, context)
        progress(f"memory at context {context}")
        for arm in ("full", *budgets):
            mx.clear_cache()
            base = mx.get_active_memory()
            mx.reset_peak_memory()
            caches = common.caches_for(sm, arm)
            common.prefill(model, caches, tokens)
            prefill_peak = mx.get_peak_memory() - base
            mx.reset_peak_memory()
            common.decode_timer(model, caches, steps, hold=True)()
            decode_peak = mx.get_peak_memory() - base
            rows.append(
                {
                    "context": context,
                    "beyond_trained_context": beyond,
                    "arm": "full" if arm == "full" else f"b{arm}",
                    **common.kv_stats(caches),
                    "prefill_peak_bytes": prefill_peak,
                    "decode_peak_bytes": decode_peak,
                }
            )
            del caches
    return rows


def plot(result, out) -> list[str]:
    plt = common.plt()
    budgets = result["settings"]["budgets"]
    ctx = [r["context"] for r in result["sweep"]]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    for arm, label in [("full_a", "full"), *((f"b{b}", f"Q-Filters budget {b}") for b in budgets)]:
        med, err = common.errorbars([r["ms_per_step"][arm] for r in result["sweep"]])
        ax.errorbar(ctx, med, yerr=err, marker="o", capsize=3, label=label)
    trained = result["model"]["context_length"]
    ax.axvline(trained, color="grey", ls=":", label=f"trained context {trained}")
    ax.set(
        xlabel="context (tokens)",
        ylabel="ms / decode step (median, IQR)",
        title="Decode step time vs context",
    )
    common.log2_axis(ax, ctx)
    ax.legend()
    names = [common.save_figure(fig, out, "decode_ms")]

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    for arm in ("full", *(f"b{b}" for b in budgets)):
        rows = [r for r in result["memory"] if r["arm"] == arm]
        x = [r["context"] for r in rows]
        a1.plot(x, [r["kept_bytes"] / 2**20 for r in rows], marker="o", label=arm)
        a2.plot(x, [r["decode_peak_bytes"] / 2**20 for r in rows], marker="o", label=arm)
    a1.set(
        xlabel="context (tokens)",
        ylabel="MiB",
        title="Kept KV bytes (all layers)",
    )
    a2.set(
        xlabel="context (tokens)",
        ylabel="MiB",
        title="Peak memory above weights, decode",
    )
    for a in (a1, a2):
        common.log2_axis(a, ctx, logy=True)
        a.legend()
    names.append(common.save_figure(fig, out, "decode_memory"))
    return names


def main(argv=None) -> dict:
    args_p = common.make_parser(__doc__.splitlines()[0], reps=7)
    args_p.add_argument("--steps", type=int, default=None, help="decode steps per timing (32)")
    args = args_p.parse_args(argv)
    reps = common.reps_of(args)
    steps = args.steps or (4 if args.quick else 32)
    progress = common.Progress("decode")
    sm = common.load_study_model(args.model)
    contexts = contexts_for(sm.context_length, args.quick)
    budgets = (64, 128) if args.quick else BUDGETS
    progress(f"model {sm.loaded.name}, contexts {[c for c, _ in contexts]}, reps {reps}")

    result = {
        "study": 6,
        "command": common.command_line("decode", argv),
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
        "sweep": sweep(sm, contexts, budgets, reps, steps, progress),
        "overhead": overhead(sm, budgets, reps, steps, progress),
        "memory": memory(sm, contexts, budgets, steps, progress),
        "runtime_s": None,
    }
    result["plots"] = plot(result, args.out)
    result["runtime_s"] = round(progress.elapsed, 1)
    path = write_json("decode", result, args.out)

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
    common.print_table(
        ["context", "full ms", "A/A ratio", *(f"b{b} ms (ratio)" for b in budgets)], rows
    )
    print("\nEviction overhead at equal size (ours at B holding B rows / KVCache holding B rows)")
    common.print_table(
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
    print("\nMemory (MiB): kept KV / decode peak above weights")
    common.print_table(
        ["context", "arm", "kept KV", "cache arrays", "prefill peak", "decode peak"],
        [
            [
                m["context"],
                m["arm"],
                m["kept_bytes"] / 2**20,
                m["cache_nbytes"] / 2**20,
                m["prefill_peak_bytes"] / 2**20,
                m["decode_peak_bytes"] / 2**20,
            ]
            for m in result["memory"]
        ],
    )
    print(f"\nwrote {path} in {result['runtime_s']}s")
    return result


if __name__ == "__main__":
    main()
