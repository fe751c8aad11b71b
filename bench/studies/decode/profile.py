"""Where a decode step and a prefill chunk spend their time, by kind of work.

MLX has no per-op profiler on its CPU backend, so each kind of work (matmuls, attention, cache
updates, sampling) is timed alone on the real step's shapes, interleaved with the real step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from bench.arms import prefill
from bench.data import prompt_tokens
from bench.plots import save_plot, subplots
from bench.report import section, table
from bench.run import start
from bench.timing import interleave, summaries, timed
from qfserve.engine.kv.attention import native_kernel
from qfserve.engine.kv.blocked import block_attention
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.factory import make_caches

PARTS = ("matmul", "attention", "cache", "sample")  # a decode step's work, each timed alone
sdpa = mx.fast.scaled_dot_product_attention


def _in_out(module: Any) -> tuple[int, int]:
    """A projection's (input, output) widths, quantized (codes packed in words) or not."""
    if isinstance(module, nn.QuantizedLinear | nn.QuantizedEmbedding):
        return module.scales.shape[1] * module.group_size, module.weight.shape[0]
    return module.weight.shape[1], module.weight.shape[0]


def _linears(model: Any) -> list[tuple[int, int, Callable[[mx.array], mx.array]]]:
    """(in, out, apply) of every weight product one token runs through, the output last."""
    found = [
        (*_in_out(m), m)
        for _, m in model.named_modules()
        if isinstance(m, nn.Linear | nn.QuantizedLinear)
    ]
    if not any(name == "lm_head" for name, _ in model.named_modules()):  # tied output
        embed = model.model.embed_tokens
        found.append((*_in_out(embed), embed.as_linear))
    return found


def _shapes(model: Any) -> tuple[int, int, int, int, float]:
    attn = model.model.layers[0].self_attn
    head_dim = attn.q_proj.weight.shape[0] // attn.n_heads
    return len(model.model.layers), attn.n_heads, attn.n_kv_heads, head_dim, attn.scale


def decode_arms(model: Any, tokens: list[int], config: CacheConfig, filters: Any) -> dict:
    n_layers, n_heads, n_kv, head_dim, scale = _shapes(model)
    filters = filters if config.evicts else None
    caches = make_caches(model, config, filters=filters)
    prefill(model, caches, tokens)
    rows = caches[0].size()
    split: dict[str, list[float]] = {"build": [], "eval": []}
    token = mx.array([[tokens[-1]]])

    def step() -> float:
        tic = time.perf_counter()
        logits = model(token, cache=caches)
        built = time.perf_counter()
        mx.argmax(logits[:, -1], axis=-1).item()
        done = time.perf_counter()
        split["build"].append(built - tic)
        split["eval"].append(done - built)
        return done - tic

    linears = _linears(model)
    inputs = {i: mx.random.normal((1, 1, i)) for i, _, _ in linears}
    q = mx.random.normal((1, n_heads, 1, head_dim))
    kv = [(mx.random.normal((1, n_kv, rows, head_dim)),) * 2 for _ in range(n_layers)]
    new = mx.random.normal((1, n_kv, 1, head_dim))
    logits = mx.random.normal((1, linears[-1][1]))
    # The cache arm updates caches of its own, filled to the same rows with random ones.
    spare = make_caches(model, config, filters=filters)
    block = mx.random.normal((1, n_kv, len(tokens), head_dim))
    for c in spare:
        c.update_and_fetch(block, block)
    mx.eval(inputs, q, kv, new, logits, [c.state for c in spare])

    kernel = native_kernel()  # attention as the step runs it: native where it is set
    attend = kernel.decode_attention if kernel is not None else partial(sdpa, mask=None)
    arms = {
        "step": step,
        "matmul": timed(lambda: [f(inputs[i]) for i, _, f in linears]),
        "attention": timed(lambda: [attend(q, k, v, scale=scale) for k, v in kv]),
        "cache": timed(lambda: [c.update_and_fetch(new, new) for c in spare]),
        "sample": timed(lambda: mx.argmax(logits, axis=-1).item()),  # read back: a host sync
    }
    return {"arms": arms, "split": split, "rows": rows}


def prefill_arms(model: Any, tokens: list[int], chunk: int) -> dict:
    n_layers, n_heads, n_kv, head_dim, scale = _shapes(model)
    offset = len(tokens) - chunk

    def forward() -> float:
        caches = make_caches(model, CacheConfig(method="full"))
        prefill(model, caches, tokens[:offset])
        tic = time.perf_counter()
        model(mx.array(tokens[offset:])[None], cache=caches)
        mx.eval([c.state for c in caches])
        return time.perf_counter() - tic

    linears = _linears(model)[:-1]  # a prefill chunk's logits are not computed
    inputs = {i: mx.random.normal((1, chunk, i)) for i, _, _ in linears}
    q = mx.random.normal((1, n_heads, chunk, head_dim))
    kv = [(mx.random.normal((1, n_kv, offset + chunk, head_dim)),) * 2 for _ in range(n_layers)]
    mx.eval(inputs, q, kv)
    arms = {
        "chunk": forward,
        "matmul": timed(lambda: [f(inputs[i]) for i, _, f in linears]),
        "attention_blocked": timed(lambda: [block_attention(q, k, v, scale) for k, v in kv]),
        "attention_mlx": timed(lambda: [sdpa(q, k, v, scale=scale, mask="causal") for k, v in kv]),
    }
    if (kernel := native_kernel()) is not None:  # what the chunk runs where it is set
        arms["attention_native"] = timed(
            lambda: [kernel.prefill_attention(q, k, v, scale) for k, v in kv]
        )
    return arms


def in_ms(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """:func:`~bench.timing.summaries` of seconds, in milliseconds."""
    return summaries({k: [v * 1e3 for v in vs] for k, vs in samples.items()})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    sm = start(
        "profile",
        argv,
        __doc__,
        reps=5,
        budget=(512, 64),
        context=(4096, 256, "tokens in the cache when decoding"),
        chunk=(512, 64, "prefill chunk tokens"),
    )
    if sm.args.chunk >= sm.args.context:  # the chunk is timed after the context's other rows
        raise SystemExit(f"--chunk ({sm.args.chunk}) must be below --context ({sm.args.context})")
    args, tokens = sm.args, prompt_tokens(sm, sm.args.context)
    configs = {
        "full": CacheConfig(method="full"),
        "qfilters": CacheConfig(method="qfilters", budget=args.budget, recent=args.budget // 4),
    }
    decode = {}
    for name, config in configs.items():
        d = decode_arms(sm.model, tokens, config, sm.filters)
        samples = interleave(d["arms"], args.reps, progress=sm.log.rounds(f"decode {name}"))
        decode[name] = {"rows": d["rows"], "ms": in_ms({**samples, **d["split"]})}
    arms = prefill_arms(sm.model, tokens, args.chunk)
    prefill_ms = in_ms(interleave(arms, args.reps, progress=sm.log.rounds("prefill")))
    fig, axes = subplots(1, 2, figsize=(10, 3.6))
    for i, (name, d) in enumerate(decode.items()):
        median = {k: v["median"] for k, v in d["ms"].items()}
        axes[0, 0].bar([f"{name}\nstep"], [median["step"]], color="black")
        bottom = 0.0
        for j, part in enumerate(PARTS):
            axes[0, 0].bar(
                [f"{name}\nparts"],
                [median[part]],
                bottom=bottom,
                label=part if i == 0 else None,
                color=f"C{j}",
            )
            bottom += median[part]
    axes[0, 0].set(ylabel="ms (median)", title=f"decode step at {args.context} tokens")
    axes[0, 0].legend(fontsize=7)
    axes[0, 1].bar(
        list(prefill_ms),
        [v["median"] for v in prefill_ms.values()],
        color=["black", "C0", "C1", "C1", "C2"][: len(prefill_ms)],
    )
    axes[0, 1].set(ylabel="ms (median)", title=f"prefill chunk of {args.chunk}")
    axes[0, 1].tick_params(axis="x", labelsize=7)
    return sm.save(
        {
            "settings": {
                "context": args.context,
                "budget": args.budget,
                "chunk": args.chunk,
                "reps": args.reps,
            },
            "decode": decode,
            "prefill_ms": prefill_ms,
            "plots": [save_plot(fig, args.out, "profile")],
        }
    )


def render(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    intro = (
        f"Each part timed alone on the step's shapes, {s['reps']} interleaved rounds, median ms "
        "[IQR]; attention as the step runs it (the native kernel where it is built); `rest` is "
        "what the parts leave unexplained (norms, RoPE, activations, per-op cost)."
    )
    columns = ("step", "build", "eval", *PARTS)
    rows = []
    for name, dec in d["decode"].items():
        median = {k: v["median"] for k, v in dec["ms"].items()}
        rest = median["step"] - sum(median[p] for p in PARTS)
        rows.append(
            [f"{name} ({dec['rows']} rows)", *(f"{median[c]:.1f}" for c in columns), f"{rest:.1f}"]
        )
    chunk = ", ".join(f"{k} {v['median']:.0f} ms" for k, v in d["prefill_ms"].items())
    prefill = f"Prefill chunk of {s['chunk']} tokens after {s['context'] - s['chunk']}: {chunk}."
    title = "Profile: a decode step and a prefill chunk, by kind of work"
    return section(
        title, d, intro, table([f"decode at {s['context']}", *columns, "rest"], rows), prefill
    )
