"""Self-calibration's prefill cost: a prompt's own Q-Filters against a plain prefill.

In process, no server. A ``--prompt``-token prompt (default 4,096, standard-library text) is
prefilled in 512-token chunks, as the server does, into Q-Filters caches at ``--budget``
(default 512, recent 128), evicting as it goes. Arms, interleaved per round: ``calibrated``
(the registry's filters, no query taps installed: what a calibrated model runs),
``self`` (no filters: the query taps of :mod:`qfserve.engine.kv.selfcal` accumulate each head's Gram
matrix until the first eviction, then the filter is computed), ``fallback`` (no filters,
the key-SVD estimate) and ``calibrated_again`` (the A/A copy). Ratios are to
``calibrated``. The goal: ``self`` within 1.10x.

Run: ``python -m bench.speed.selfcal_prefill [--quick] [--model M] [--reps 3] [--prompt 4096]``.
Writes ``bench/results/<model>/selfcal_prefill.json`` and ``selfcal_prefill.png``.
"""

from __future__ import annotations

from qfserve.engine.models.blas import reexec_with_openblas

reexec_with_openblas()

import time  # noqa: E402

from bench.cli import command_line, parse, parser  # noqa: E402
from bench.harness import interleave, print_table, ratio_row, summary, write_results  # noqa: E402
from bench.speed import common  # noqa: E402
from qfserve.engine.kv.config import CacheConfig  # noqa: E402
from qfserve.engine.kv.factory import make_caches  # noqa: E402
from qfserve.engine.kv.selfcal import install_query_taps, remove_query_taps  # noqa: E402

ARMS = ("calibrated", "self", "fallback", "calibrated_again")


def main(argv=None) -> dict:
    p = parser(__doc__.splitlines()[0], reps=3)
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 4096)")
    p.add_argument("--budget", type=int, default=None, help="(default 512)")
    args = parse(p, argv)
    n = args.prompt or (256 if args.quick else 4096)
    budget = args.budget or (32 if args.quick else 512)
    progress = common.Progress("selfcal_prefill")
    sm = common.load_study_model(args.model)
    model = sm.loaded.model
    tokens = common.prompt_tokens(sm, n)
    config = CacheConfig(method="qfilters", budget=budget, recent=budget // 4)
    sources: dict[str, str] = {}

    def arm(name: str):
        def run() -> float:
            tapped = name == "self"
            if tapped:
                install_query_taps(model)
            else:
                remove_query_taps(model)
            filters = sm.filters if name.startswith("calibrated") else None
            caches = make_caches(model, config, filters=filters, self_calibrate=tapped)
            tic = time.perf_counter()
            common.prefill(model, caches, tokens)
            elapsed = time.perf_counter() - tic
            sources[name] = caches[0].scorer.source
            return elapsed

        return run

    runs = interleave({a: arm(a) for a in ARMS}, args.reps, progress=progress.rounds("prefill"))
    remove_query_taps(model)
    result = {
        "study": "selfcal_prefill",
        "command": command_line("bench.speed.selfcal_prefill", argv),
        "quick": args.quick,
        "model": sm.describe(),
        "settings": {
            "prompt_tokens": n,
            "prefill_chunk": 512,
            "budget": budget,
            "recent": budget // 4,
            "reps": args.reps,
            "filter_sources": sources,
        },
        "prefill_s": {a: summary(v) for a, v in runs.items()},
        "tokens_per_s": {a: n / summary(v)["median"] for a, v in runs.items()},
        "ratios": [ratio_row(runs, a, "calibrated") for a in ARMS[1:]],
    }
    plt = common.plt()
    fig, ax = plt.subplots(figsize=(5, 3.4))
    medians = [result["prefill_s"][a]["median"] for a in ARMS]
    ax.bar(ARMS, medians, color=["tab:blue", "tab:purple", "tab:orange", "tab:blue"])
    ax.set(ylabel="prefill seconds (median)", title=f"{n}-token prompt, budget {budget}")
    ax.tick_params(axis="x", labelsize=8)
    result["plots"] = [common.save_figure(fig, args.out, "selfcal_prefill")]
    result["runtime_s"] = round(progress.elapsed, 1)
    path = write_results("selfcal_prefill", result, args.out, section="speed")
    table = [
        [r["arm"], f"{result['prefill_s'][r['arm']]['median']:.2f}", f"{r['median']:.3f}",
         f"{r['min']:.3f}-{r['max']:.3f}"]
        for r in result["ratios"]
    ]  # fmt: skip
    table.insert(0, ["calibrated", f"{result['prefill_s']['calibrated']['median']:.2f}", "1", ""])
    print_table(["arm", "prefill s", "ratio to calibrated", "range"], table)
    print(f"\nwrote {path} in {result['runtime_s']}s")
    return result


if __name__ == "__main__":
    main()
