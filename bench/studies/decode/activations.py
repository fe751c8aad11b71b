"""What decode steps round activations to before their products on quantized weights
(``--decode-activations``): each setting's step time at one sequence and its likelihood and
greedy choices against float32's, token by token on the same text."""

from __future__ import annotations

import math
from typing import Any

import mlx.core as mx
import numpy as np

from bench import cli, plots, timing
from bench.arms import caches_for, decode_timer, prefill
from bench.data import prompt_tokens
from bench.report import ms, ratio_cell, section, table
from bench.run import open_run
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.models.quantized import kernel_of
from qfserve.kernels.native import ACTIVATIONS, DEFAULT_ACTIVATIONS

REFERENCE = "float32"


def scored(run: Any, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Each next token's negative log-likelihood and the argmax, fed one token at a time (a
    decode step's rows) over a full cache."""
    caches = make_caches(run.model, CacheConfig(method="full"))
    nll, top = [], []
    for now, after in zip(tokens, tokens[1:], strict=False):
        logits = run.model(mx.array([[now]]), cache=caches)[0, -1].astype(mx.float32)
        logprobs = logits - mx.logsumexp(logits)
        mx.eval(logprobs)
        row = np.array(logprobs)
        nll.append(-float(row[after]))
        top.append(int(row.argmax()))
    return np.array(nll), np.array(top)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = cli.parser(
        __doc__,
        file="activations",
        reps=5,
        steps=(16, 4, "decode steps per timing"),
        prompt=(256, 32, "prompt tokens before the timed steps"),
        budget=(512, 32, "Q-Filters budget of the timed sequence"),
        scored=(800, 24, "tokens scored one at a time against float32's"),
    )
    args = cli.parse(p, argv)
    run = open_run("activations", args, argv)
    kernel = kernel_of(run.model)
    if kernel is None or not kernel.integer_activations:
        raise SystemExit(
            "activations: needs the native kernel on a CPU with AVX-512 VNNI or AVX2 (products on "
            "codes); this model or machine multiplies float32 only"
        )
    names = list(ACTIVATIONS)  # int32 (the default), int16, int8, float32
    arms: dict[str, Any] = {}
    for name in [*names, f"{REFERENCE}_b"]:  # float32 twice: the A/A row
        caches = caches_for(run, args.budget)
        prefill(run.model, caches, prompt_tokens(run, args.prompt))
        timer = decode_timer(run.model, caches, args.steps, hold=True)
        bits = ACTIVATIONS[name.removesuffix("_b")]

        def arm(timer: Any = timer, bits: int = bits) -> float:
            kernel.activation_bits(bits)
            return float(timer())

        arms[name] = arm
    _, summaries, ratios = timing.compare_arms(run, arms, "activations", REFERENCE)
    tokens = prompt_tokens(run, args.scored)
    run.log(f"scoring {len(tokens)} tokens one at a time, per setting")
    quality: dict[str, dict[str, float]] = {}
    reference_nll, reference_top = None, None
    for name in [REFERENCE, *(n for n in names if n != REFERENCE)]:
        kernel.activation_bits(ACTIVATIONS[name])
        nll, top = scored(run, tokens)
        if reference_nll is None:
            reference_nll, reference_top = nll, top
        quality[name] = {
            "perplexity": math.exp(float(nll.mean())),
            "argmax_agreement": float(np.mean(top == reference_top)),
            "mean_abs_nll_change": float(np.abs(nll - reference_nll).mean()),
            "max_abs_nll_change": float(np.abs(nll - reference_nll).max()),
        }
    kernel.activation_bits(ACTIVATIONS[DEFAULT_ACTIVATIONS])  # as the study found it
    result = {
        "settings": {
            "reps": args.reps,
            "steps": args.steps,
            "prompt": args.prompt,
            "budget": args.budget,
            "method": "qfilters",
            "scored_tokens": len(tokens),
            "scored_with": "full cache, one token a step (the decode path)",
        },
        "ms_per_step": summaries,
        "ratios": ratios,
        "quality": quality,
    }
    fig, [[left, right]] = plots.subplots(1, 2, figsize=(9.6, 3.6))
    left.bar(list(summaries), [s["median"] for s in summaries.values()], color="C0")
    left.set(ylabel="ms per decode step", title=f"one sequence, Q-Filters {args.budget}")
    right.bar(list(quality), [100 * q["argmax_agreement"] for q in quality.values()], color="C2")
    right.set(ylabel="% argmax as float32's", ylim=(80, 100.5), title="greedy choices")
    result["plots"] = [plots.save_plot(fig, args.out, "activations")]
    return run.save(result)


def render(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    intro = (
        f"In process, one sequence: {s['steps']} decode steps a timing after a "
        f"{s['prompt']}-token prompt, Q-Filters {s['budget']}, {s['reps']} interleaved rounds "
        f"(`{REFERENCE}_b`: the A/A row). Quality: {s['scored_tokens']} tokens of the corpus "
        f"scored one at a time ({s['scored_with']}) under each setting, against float32's."
    )
    to_reference = {r["arm"]: ratio_cell(r) for r in d["ratios"]}
    rows = [
        [
            name,
            ms(summary),
            to_reference.get(name, "—"),
            f"{d['quality'][name]['perplexity']:.3f}" if name in d["quality"] else "",
            f"{100 * d['quality'][name]['argmax_agreement']:.2f}%" if name in d["quality"] else "",
            f"{d['quality'][name]['mean_abs_nll_change']:.5f}" if name in d["quality"] else "",
        ]
        for name, summary in d["ms_per_step"].items()
    ]
    headers = [
        "activations",
        "ms/step",
        "step vs float32",
        "perplexity",
        "argmax as float32's",
        "mean |Δ NLL|",
    ]
    return section(
        "Decode activations: step time and what the rounding costs", d, intro, table(headers, rows)
    )
