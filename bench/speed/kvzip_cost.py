"""KVzip's cost: a prompt prefilled and reconstructed, against a plain prefill, then decode.

In process, no server. A ``--prompt``-token prompt (standard-library text) is prefilled in
512-token chunks, as the server does. Arms, interleaved per round: ``qfilters`` (calibrated
Q-Filters at ``--budget``, evicting as it reads: the cheap mode), ``kvzip`` (the prompt kept
whole, then :mod:`qfserve.engine.kv.kvzip`'s reconstruction pass, 512 tokens a forward pass, and the
eviction to ``--budget``), ``full`` (the plain prefill the goal is measured against) and
``full_again`` (its A/A copy). Prefill ratios are to ``full``; the goal is kvzip within 2.5x.
Then the decode step at budget: ``--steps`` steps of each evicting arm's caches after its
prefill (ms/step, interleaved, ratio to ``qfilters``: the same O(budget) single-row step).
Peak memory is MLX's, reset before each arm's prefill.

Run: ``python -m bench.speed.kvzip_cost [--quick] [--reps 3] [--prompt 2048] [--budget 256]``.
Writes ``bench/results/<model>/kvzip_cost.json`` and ``kvzip_cost.png``.
"""

from __future__ import annotations

from qfserve.engine.models.blas import reexec_with_openblas

reexec_with_openblas()

import time  # noqa: E402

import mlx.core as mx  # noqa: E402

from bench.cli import command_line, parse, parser  # noqa: E402
from bench.harness import interleave, print_table, ratio_row, summary, write_results  # noqa: E402
from bench.speed import common  # noqa: E402
from qfserve.engine.kv.config import CacheConfig  # noqa: E402
from qfserve.engine.kv.factory import make_caches  # noqa: E402
from qfserve.engine.kv.kvzip import RepeatPrompt, compress  # noqa: E402

ARMS = ("full", "qfilters", "kvzip", "full_again")


def main(argv=None) -> dict:
    p = parser(__doc__.splitlines()[0], reps=3)
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 2048)")
    p.add_argument("--budget", type=int, default=None, help="(default 256)")
    p.add_argument("--steps", type=int, default=None, help="decode steps timed (default 32)")
    args = parse(p, argv)
    n = args.prompt or (200 if args.quick else 2048)
    budget = args.budget or (32 if args.quick else 256)
    steps = args.steps or (4 if args.quick else 32)
    progress = common.Progress("kvzip_cost")
    sm = common.load_study_model(args.model)
    model = sm.loaded.model
    tokens = common.prompt_tokens(sm, n)
    repeat = RepeatPrompt.for_tokenizer(sm.loaded.tokenizer)
    configs = {
        "full": CacheConfig(method="full"),
        "qfilters": CacheConfig(method="qfilters", budget=budget, recent=budget // 4),
        "kvzip": CacheConfig(method="kvzip", budget=budget, recent=budget // 4),
    }
    peaks: dict[str, int] = {}
    filled: dict[str, list] = {}

    def prefill_arm(name: str):
        config = configs[name.removesuffix("_again")]

        def run() -> float:
            caches = make_caches(
                model, config, filters=None if config.method == "full" else sm.filters
            )
            mx.reset_peak_memory()
            tic = time.perf_counter()
            common.prefill(model, caches, tokens)
            if config.method == "kvzip":
                compress(model, caches, tokens, repeat)
            elapsed = time.perf_counter() - tic
            peaks[name] = mx.get_peak_memory()
            filled[name] = caches
            return elapsed

        return run

    runs = interleave(
        {a: prefill_arm(a) for a in ARMS}, args.reps, progress=progress.rounds("prefill")
    )
    kept = {a: filled[a][0].size() for a in ("qfilters", "kvzip")}
    steps_ms = interleave(
        {
            a: common.decode_timer(model, filled[a], steps, hold=False)
            for a in ("qfilters", "kvzip")
        },
        args.reps,
        progress=progress.rounds("decode"),
    )
    result = {
        "study": "kvzip_cost",
        "command": command_line("bench.speed.kvzip_cost", argv),
        "quick": args.quick,
        "model": sm.describe(),
        "settings": {
            "prompt_tokens": n,
            "prefill_chunk": 512,
            "budget": budget,
            "recent": budget // 4,
            "reps": args.reps,
            "decode_steps": steps,
            "kept_rows_after_prefill": kept,
        },  # fmt: skip
        "prefill_s": {a: summary(v) for a, v in runs.items()},
        "prefill_ratios": [ratio_row(runs, a, "full") for a in ARMS[1:]],
        "peak_memory_bytes": peaks,
        "decode_ms": {a: summary(v) for a, v in steps_ms.items()},
        "decode_ratios": [ratio_row(steps_ms, "kvzip", "qfilters")],
    }
    plt = common.plt()
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    ax[0].bar(ARMS, [result["prefill_s"][a]["median"] for a in ARMS],
              color=["black", "tab:blue", "darkgoldenrod", "black"])  # fmt: skip
    ax[0].set(ylabel="prefill seconds (median)", title=f"{n}-token prompt, budget {budget}")
    ax[1].bar(["qfilters", "kvzip"], [result["decode_ms"][a]["median"] for a in ("qfilters", "kvzip")],
              color=["tab:blue", "darkgoldenrod"])  # fmt: skip
    ax[1].set(ylabel="ms per decode step (median)", title="decode at budget")
    result["plots"] = [common.save_figure(fig, args.out, "kvzip_cost")]
    result["runtime_s"] = round(progress.elapsed, 1)
    path = write_results("kvzip_cost", result, args.out, section="speed")
    table = [[r["arm"], f"{result['prefill_s'][r['arm']]['median']:.2f}", f"{r['median']:.3f}",
              f"{r['min']:.3f}-{r['max']:.3f}", f"{peaks[r['arm']] / 2**20:.0f}"]
             for r in result["prefill_ratios"]]  # fmt: skip
    table.insert(0, ["full", f"{result['prefill_s']['full']['median']:.2f}", "1", "",
                     f"{peaks['full'] / 2**20:.0f}"])  # fmt: skip
    print_table(["arm", "prefill s", "ratio to full", "range", "peak MiB"], table)
    d = result["decode_ratios"][0]
    print(f"decode: qfilters {result['decode_ms']['qfilters']['median']:.1f} ms/step, kvzip "
          f"{result['decode_ms']['kvzip']['median']:.1f} ms/step (ratio {d['median']:.3f})")  # fmt: skip
    print(f"\nwrote {path} in {result['runtime_s']}s")
    return result


if __name__ == "__main__":
    main()
