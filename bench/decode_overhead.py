"""Decode cost of the eviction cache against mlx-lm's own KVCache.

Two studies, each with arms interleaved in one process:

1. Overhead at equal size: our cache at ``budget`` holding ``budget`` rows (evicting one row
   per step) against ``KVCache`` holding ``budget`` rows (trimmed back by one after each
   step, so both attend over ``budget + 1`` rows). Goal: ratio <= 1.05.
2. Long context: ``KVCache`` holding ``context`` rows against our cache at a budget.

Study 6 of the results page (``python -m bench.speed.decode``) repeats part 1 on the bundled
model beside the context sweep; this script stays on the random test model, a quick check.

Run: ``python -m bench.decode_overhead [--reps 7] [--steps 64]``. Prints a table and writes
``bench/results/decode_overhead.json``.
"""

from __future__ import annotations

import argparse
import time

from engine.blas import reexec_with_openblas

reexec_with_openblas()

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache, make_prompt_cache  # noqa: E402

from bench.harness import interleave, ratio_row, summary, write_json  # noqa: E402
from engine.config import CacheConfig  # noqa: E402
from engine.factory import make_caches  # noqa: E402
from tests.tiny import make_tiny_model  # noqa: E402


def prefill(model, caches, n_tokens: int, chunk: int = 512) -> None:
    tokens = mx.random.randint(0, 500, (n_tokens,), key=mx.random.key(0))
    for s in range(0, n_tokens, chunk):
        model(tokens[None, s : s + chunk], cache=caches)
        mx.eval([c.state for c in caches])


def decode_arm(model, caches, steps: int, hold: bool):
    """A callable timing ``steps`` decode steps; ``hold`` trims KVCache back after each."""
    token = mx.array([[17]])

    def run() -> float:
        tic = time.perf_counter()
        for _ in range(steps):
            logits = model(token, cache=caches)
            mx.eval(logits, [c.state for c in caches])
            if hold:
                for c in caches:
                    c.trim(1)
        return (time.perf_counter() - tic) / steps * 1e3  # ms/step

    return run


def kv_caches(model, rows: int):
    caches = make_prompt_cache(model)
    assert all(type(c) is KVCache for c in caches)
    prefill(model, caches, rows)
    return caches


def ours(model, budget: int, rows: int, method: str = "qfilters"):
    caches = make_caches(model, CacheConfig(method=method, budget=budget, recent=budget // 4))
    prefill(model, caches, rows)
    return caches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--long-budget", type=int, default=512)
    args = parser.parse_args()
    model = make_tiny_model(seed=0)
    b = args.budget

    print(f"[1/2] equal size: budget {b}, {args.reps} reps x {args.steps} steps, interleaved")
    arms = {
        "kvcache_a": decode_arm(model, kv_caches(model, b), args.steps, hold=True),
        "kvcache_b": decode_arm(model, kv_caches(model, b), args.steps, hold=True),
        "qfilters_fallback": decode_arm(model, ours(model, b, 4 * b), args.steps, hold=False),
        "knorm": decode_arm(model, ours(model, b, 4 * b, "knorm"), args.steps, hold=False),
    }
    equal = interleave(arms, args.reps)

    print(f"[2/2] long context: {args.context} rows full vs budget {args.long_budget}")
    long_arms = {
        "full_a": decode_arm(model, kv_caches(model, args.context), args.steps, hold=True),
        "full_b": decode_arm(model, kv_caches(model, args.context), args.steps, hold=True),
        "qfilters": decode_arm(
            model, ours(model, args.long_budget, args.context), args.steps, hold=False
        ),
    }
    long = interleave(long_arms, args.reps)

    rows = [
        ("equal size", ratio_row(equal, "kvcache_b", "kvcache_a"), "A/A noise floor"),
        ("equal size", ratio_row(equal, "qfilters_fallback", "kvcache_a"), f"ours at budget {b}"),
        ("equal size", ratio_row(equal, "knorm", "kvcache_a"), f"ours (knorm) at budget {b}"),
        ("long context", ratio_row(long, "full_b", "full_a"), "A/A noise floor"),
        (
            "long context",
            ratio_row(long, "qfilters", "full_a"),
            f"budget {args.long_budget} vs full {args.context}",
        ),
    ]
    print(f"\n{'study':<13} {'arm / reference':<34} {'median':>7} {'q1':>7} {'q3':>7}  note")
    for study, r, note in rows:
        print(
            f"{study:<13} {r['arm'] + ' / ' + r['reference']:<34} {r['median']:>7.3f} "
            f"{r['q1']:>7.3f} {r['q3']:>7.3f}  {note}"
        )
    print(
        "\nms/step medians: "
        + ", ".join(f"{k}={summary(v)['median']:.3f}" for k, v in {**equal, **long}.items())
    )

    path = write_json(
        "decode_overhead",
        {
            "model": "tests.tiny (random weights: 2 layers, 4 q heads, 2 kv heads, head_dim 32)",
            "args": vars(args),
            "ms_per_step": {k: summary(v) for k, v in {**equal, **long}.items()},
            "ratios": [{"study": s, "note": n, **r} for s, r, n in rows],
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
