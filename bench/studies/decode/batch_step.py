"""One decode step of a batch of ``B`` requests, as the server takes it, and where it goes.

The step is the scheduler's :class:`~qfserve.engine.serving.decoding.DecodeBatch` (mlx-lm's
``GenerationBatch``, its vocabulary normalised natively) ``.next`` over
:class:`~qfserve.engine.kv.batch.BatchCache` layers whose members are per-request caches of
mixed methods and budgets (as the batching study's streams ask), sampling and stop checks
included. Beside it, interleaved round by round: the model's forward alone on the same caches,
the same forward on mlx-lm's ``BatchKVCache`` of as many rows (the reference a batch of plain
caches costs), and each kind of work alone on the step's shapes (MLX has no per-op profiler on
its CPU backend): the weight products at ``B`` rows, attention over the batch's rows, the batch
caches' update and eviction, sampling with its read-back, and the detokenizing the scheduler
does per member. ``rest`` is what the parts leave unexplained: norms, RoPE, residuals, and
building and dispatching the graph.
"""

from __future__ import annotations

import time
from typing import Any

import mlx.core as mx
from mlx_lm.generate import make_stop_sequences
from mlx_lm.models.cache import BatchKVCache, KVCache
from mlx_lm.sample_utils import make_sampler

from bench.arms import make_caches, prefill
from bench.data import prompt_tokens
from bench.plots import log2_axis, save_plot, subplots
from bench.report import section, table
from bench.run import start
from bench.studies.decode.profile import _linears, _shapes
from bench.timing import interleave, ratio_row, summaries, timed
from qfserve.engine.kv.attention import install_head_masks, native_kernel
from qfserve.engine.kv.batch import BatchCache
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.serving.decoding import DecodeBatch, normalise

PARTS = ("products", "attention", "cache", "sample", "detokenize")  # timed alone
MIXES = (  # what each member asks for, in turn (the batching study's mix)
    {"method": "qfilters"},
    {"method": "full"},
    {"method": "knorm"},
    {"method": "streaming"},
)


def member_config(i: int, budget: int) -> CacheConfig:
    mix = MIXES[i % len(MIXES)]
    if mix["method"] == "full":
        return CacheConfig(method="full")
    return CacheConfig(method=mix["method"], budget=budget, recent=budget // 4)


def member_caches(sm, i: int, tokens: list[int]) -> list[Any]:
    config = member_config(i, sm.args.budget)
    filters = sm.filters if config.method == "qfilters" else None
    caches = make_caches(sm.model, config, filters=filters)
    prefill(sm.model, caches, tokens)
    return caches


def build(sm, B: int) -> tuple[DecodeBatch, list[BatchCache], list[Any]]:
    """The batch as the scheduler builds it (members joined one at a time), a spare set of
    batch caches of the same members for the cache arm, and mlx-lm's batch of plain caches
    holding as many rows as ours."""
    P = sm.args.prompt
    base, sampler = prompt_tokens(sm, P * B), make_sampler(0.0)
    batch = DecodeBatch.empty(sm.model, sampler)
    spare: list[list[Any]] = []
    plain: list[list[Any]] = []
    stops = make_stop_sequences(sm.tokenizer)
    for b in range(B):
        tokens = base[b * P : (b + 1) * P]
        caches = member_caches(sm, b, tokens[:-1])
        spare.append(member_caches(sm, b, tokens[:-1]))
        newcomer = DecodeBatch(
            sm.model,
            [b],
            mx.array(tokens[-1:]),
            [BatchCache([c]) for c in caches],
            [list(tokens[:-1])],
            [sampler],
            sampler,
            [[]],
            [stops],
            [1 << 30],
        )
        batch.extend(newcomer)
        rows = caches[0].size()
        kept = [KVCache() for _ in sm.model.layers]
        sm.model(mx.array([tokens[-rows:]]), cache=kept)
        mx.eval([c.state for c in kept])
        plain.append(kept)
    layers = range(len(sm.model.layers))
    spare_batch = [BatchCache([s[i] for s in spare]) for i in layers]
    theirs = [BatchKVCache.merge([p[i] for p in plain]) for i in layers]
    return batch, spare_batch, theirs


def measure(sm, B: int) -> dict[str, Any]:
    """One batch size's row: the step, the forward on ours and on mlx-lm's caches, and each
    part alone."""
    a, model = sm.args, sm.model
    sm.log(f"batch {B}: prefilling {B} prompts of {a.prompt} tokens")
    batch, spare, theirs = build(sm, B)
    for _ in range(2):  # the members' first steps (packing the batch) are not steady state
        batch.next()
    mx.synchronize()
    n_layers, n_heads, n_kv, head_dim, scale = _shapes(model)
    token = mx.array([[prompt_tokens(sm, 1)[0]]] * B)
    rows = batch.prompt_cache[0].size()
    linears = _linears(model)
    inputs = {i: mx.random.normal((B, 1, i)) for i, _, _ in linears}
    q = mx.random.normal((B, n_heads, 1, head_dim))
    kv = [(mx.random.normal((B, n_kv, rows, head_dim)),) * 2 for _ in range(n_layers)]
    new = mx.random.normal((B, n_kv, 1, head_dim))
    logits = mx.random.normal((B, linears[-1][1]))
    mx.eval(inputs, q, kv, new, logits)
    kernel = native_kernel()
    attend = kernel.decode_attention if kernel is not None else mx.fast.scaled_dot_product_attention
    sampler = make_sampler(0.0)
    detokenizers = [sm.tokenizer.detokenizer for _ in range(B)]
    pieces = prompt_tokens(sm, 4096)

    def step() -> float:
        # next() hands back the last step's tokens and queues this one (async_eval): waiting
        # for it times one whole step, and no queued work lands in the next arm's time.
        tic = time.perf_counter()
        batch.next()
        mx.synchronize()
        return time.perf_counter() - tic

    def detokenize() -> float:
        tic = time.perf_counter()
        for i, d in enumerate(detokenizers):
            d.add_token(pieces[(len(d.tokens) + i) % len(pieces)])
            d.last_segment  # noqa: B018 - what the scheduler reads each token
        return time.perf_counter() - tic

    arms = {
        "step": step,
        "forward": timed(lambda: model(token, cache=batch.prompt_cache)),
        "theirs": timed(lambda: model(token, cache=theirs)),
        "products": timed(lambda: [f(inputs[i]) for i, _, f in linears]),
        "attention": timed(lambda: [attend(q, k, v, scale=scale) for k, v in kv]),
        "cache": timed(lambda: [c.update_and_fetch(new, new) for c in spare]),
        "sample": lambda: _sample(sampler, logits),
        "detokenize": detokenize,
        "step_again": step,
    }
    runs = interleave(arms, a.reps, progress=sm.log.rounds(f"batch {B}"))
    for c in theirs:  # mlx-lm's caches grew a row a round: keep them at ours' rows
        c.trim(a.reps + 1)
    pairs = (("step_again", "step"), ("forward", "theirs"), ("step", "forward"))
    return {
        "batch": B,
        "rows": rows,
        "methods": [member_config(i, a.budget).method for i in range(B)],
        "ms": {
            k: {s: v * 1e3 if s != "n" else v for s, v in d.items()}
            for k, d in summaries(runs).items()
        },
        "ratios": [ratio_row(runs, *p) for p in pairs],
    }


def _sample(sampler: Any, logits: mx.array) -> float:
    tic = time.perf_counter()
    logprobs, best = normalise(logits)  # as the step: log-probabilities, then the draw
    mx.eval(logprobs)
    (best if best is not None else sampler(logprobs)).tolist()  # read back: the step's sync
    return time.perf_counter() - tic


def main(argv: list[str] | None = None) -> dict[str, Any]:
    sm = start(
        "batch_step",
        argv,
        __doc__,
        reps=7,
        batches=([1, 4, 8, 16], [1, 2]),
        prompt=(256, 48, "tokens per prompt"),
        budget=(128, 16, "the evicting members' rows"),
    )
    args = sm.args
    install_head_masks(sm.model)
    rows = [measure(sm, B) for B in args.batches]
    one = next((r["ms"]["step"]["median"] for r in rows if r["batch"] == 1), None)
    for r in rows:
        r["tokens_per_s"] = r["batch"] * 1e3 / r["ms"]["step"]["median"]
        if one is not None:
            r["tokens_per_s_over_batch_1"] = r["batch"] * one / r["ms"]["step"]["median"]
    result = {
        "settings": {
            "batches": args.batches,
            "prompt": args.prompt,
            "budget": args.budget,
            "reps": args.reps,
            "mix": [c["method"] for c in MIXES],
            "theirs": "the model's forward on mlx-lm's BatchKVCache.merge of KVCaches of as many rows",
        },
        "rows": rows,
    }
    fig, axes = subplots(1, 2, figsize=(11, 3.8))
    ax = axes[0, 0]
    labels = [str(r["batch"]) for r in rows]
    bottom = [0.0] * len(rows)
    for j, part in enumerate((*PARTS, "rest")):
        heights = [_part(r, part) for r in rows]
        ax.bar(labels, heights, bottom=bottom, label=part, color=f"C{j}")
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax.plot(labels, [r["ms"]["step"]["median"] for r in rows], "ko-", label="step")
    ax.set(title="a batch's decode step by kind of work (ms)", xlabel="members")
    ax.legend(fontsize=7)
    ax = axes[0, 1]
    ax.plot(args.batches, [r["tokens_per_s"] for r in rows], "o-", label="tokens/s")
    ax.set(title="aggregate tokens/s of the step", xlabel="members")
    log2_axis(ax, args.batches)
    result["plots"] = [save_plot(fig, args.out, "batch_step")]
    return sm.save(result)


def _part(row: dict[str, Any], part: str) -> float:
    ms = {k: v["median"] for k, v in row["ms"].items()}
    if part != "rest":
        return ms[part]
    return max(0.0, ms["step"] - sum(ms[p] for p in PARTS))


def render(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    intro = (
        f"In process, the scheduler's `DecodeBatch.next` over per-request caches of "
        f"{', '.join(s['mix'])} in turn (evicting ones at {s['budget']} rows), prompts of "
        f"{s['prompt']} tokens; {s['reps']} interleaved rounds, median ms. Parts are timed "
        "alone on the step's shapes; `rest` is the step less the parts (norms, RoPE, "
        f"residuals, graph building and dispatch). `theirs`: {s['theirs']}; `A/A`: the step "
        "against itself."
    )
    headers = ["members", "rows", "step", *PARTS, "rest", "forward", "theirs"]
    headers += ["A/A", "forward/theirs", "tok/s", "× one member"]
    rows = []
    for r in d["rows"]:
        ms = {k: v["median"] for k, v in r["ms"].items()}
        rows.append(
            [
                r["batch"],
                r["rows"],
                *(f"{ms[c]:.1f}" for c in ("step", *PARTS)),
                f"{_part(r, 'rest'):.1f}",
                f"{ms['forward']:.1f}",
                f"{ms['theirs']:.1f}",
                *(f"{x['median']:.2f}" for x in r["ratios"][:2]),
                f"{r['tokens_per_s']:.0f}",
                f"{r['tokens_per_s_over_batch_1']:.2f}×"
                if "tokens_per_s_over_batch_1" in r
                else "—",
            ]
        )
    title = "A batch's decode step by kind of work, 1 to 16 members"
    return section(title, d, intro, table(headers, rows))
