"""Study 8: what HTTP adds. A streamed chat request through ``qfserve`` against in-process
generation of the same prompt (same engine code, caches and greedy settings).

The server runs as a subprocess on an ephemeral 127.0.0.1 port, loading the same model
folder; the client is ``httpx`` streaming ``/v1/chat/completions``. In process, the prompt
goes through the engine's own ``encode_prompt``, ``make_caches`` and mlx-lm's
``stream_generate`` with the sampler and logits processors the worker builds. Both ban the
end-of-sequence tokens (``logit_bias``) so every request makes exactly ``max_tokens``.
TTFT is the time to the first non-empty text; inter-token latency (ITL) is
``(end - first) / (completion_tokens - 1)``. Arms interleaved: in-process, HTTP, in-process,
HTTP; the two copies of each are the A/A pairs.

Run: ``python -m bench.speed.server_overhead [--quick] [--model DIR] [--reps 7]``.
Writes ``bench/results/server_overhead.json`` and ``server_overhead.png``.
"""

from __future__ import annotations

from engine.blas import reexec_with_openblas

reexec_with_openblas()

import time  # noqa: E402

import httpx  # noqa: E402
from mlx_lm import stream_generate  # noqa: E402
from mlx_lm.sample_utils import make_logits_processors, make_sampler  # noqa: E402

from bench.harness import interleave, ratio_row, summary, write_json  # noqa: E402
from bench.speed import common  # noqa: E402
from engine.config import CacheConfig  # noqa: E402
from engine.prompts import encode_prompt  # noqa: E402
from engine.requests import GenerationRequest, SamplingParams  # noqa: E402


def in_process(sm, content: str, max_tokens: int, config: CacheConfig, bias: dict):
    """A callable generating like the worker does, timed the way the HTTP client is."""
    request = GenerationRequest(
        kind="chat",
        sampling=SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0,
            logit_bias=tuple((int(k), v) for k, v in bias.items()),
        ),
        cache=config,
        messages=({"role": "user", "content": content},),
    )

    def run() -> common.StreamTiming:
        tic = time.perf_counter()
        prompt, n = encode_prompt(sm.loaded, request)
        caches = common.make_caches(
            sm.loaded.model, config, filters=sm.filters if config.method == "qfilters" else None
        )
        sampler = make_sampler(0.0, top_p=1.0)
        processors = make_logits_processors(dict(request.sampling.logit_bias))
        ttft, chunks, last = None, 0, None
        for gen in stream_generate(
            sm.loaded.model,
            sm.loaded.tokenizer,
            prompt,
            max_tokens=n,
            sampler=sampler,
            logits_processors=processors,
            prompt_cache=caches,
        ):
            if gen.text:
                chunks += 1
                if ttft is None:
                    ttft = time.perf_counter() - tic
            last = gen
        total = time.perf_counter() - tic
        return common.StreamTiming(
            ttft=ttft or total,
            total=total,
            completion_tokens=last.generation_tokens,
            prompt_tokens=len(prompt),
            chunks=chunks,
        )

    return run


def over_http(client, url: str, body: dict):
    return lambda: common.stream_chat(client, url, body)


def plot(result, out) -> list[str]:
    plt = common.plt()
    arms = list(result["ttft_s"])
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(9, 3.6))
    for ax, key, title in ((a1, "ttft_s", "TTFT (ms)"), (a2, "itl_s", "inter-token latency (ms)")):
        med, err = common.errorbars([result[key][a] for a in arms])
        ax.bar(
            arms,
            [m * 1e3 for m in med],
            yerr=[[e * 1e3 for e in s] for s in err],
            capsize=4,
            color=["C0" if a.startswith("in_") else "C1" for a in arms],
        )
        ax.set(title=title + ", median and IQR")
    fig.suptitle(
        f"HTTP vs in-process, prompt {result['settings']['prompt_tokens']} tokens, "
        f"{result['settings']['max_tokens']} generated"
    )
    return [common.save_figure(fig, out, "server_overhead")]


def main(argv=None) -> dict:
    p = common.make_parser(__doc__.splitlines()[0], reps=7)
    p.add_argument("--prompt-tokens", type=int, default=None, help="(default 1000; quick 64)")
    p.add_argument("--max-tokens", type=int, default=None, help="(default 64; quick 8)")
    p.add_argument("--budget", type=int, default=None, help="Q-Filters budget (default 512)")
    args = p.parse_args(argv)
    reps = common.reps_of(args)
    n_prompt = args.prompt_tokens or (64 if args.quick else 1000)
    max_tokens = args.max_tokens or (8 if args.quick else 64)
    budget = args.budget or (32 if args.quick else 512)
    progress = common.Progress("server_overhead")
    sm = common.load_study_model(args.model)
    config = CacheConfig(method="qfilters", budget=budget)
    content = common.chat_content(sm, n_prompt)
    bias = common.eos_ban(sm)
    body = {
        "model": sm.loaded.name,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "logit_bias": bias,
        "kv_method": "qfilters",
        "qfilters_budget": budget,
    }
    progress(f"starting qfserve on {sm.path.name}")
    with common.serve("qfserve", model=sm.path) as (url,), httpx.Client() as client:
        progress(f"serving at {url}; {reps} reps, prompt ~{n_prompt}, {max_tokens} tokens")
        local = in_process(sm, content, max_tokens, config, bias)
        remote = over_http(client, url, body)
        arms = {"in_process_a": local, "http_a": remote, "in_process_b": local, "http_b": remote}
        runs = interleave(arms, reps, progress=progress.rounds("requests"))
    ttft = {k: [t.ttft for t in v] for k, v in runs.items()}
    itl = {k: [t.itl for t in v] for k, v in runs.items()}
    tokens = {k: sorted({t.completion_tokens for t in v}) for k, v in runs.items()}
    prompt_tokens = {k: sorted({t.prompt_tokens for t in v}) for k, v in runs.items()}
    pairs = [("in_process_b", "in_process_a"), ("http_b", "http_a"), ("http_a", "in_process_a")]
    result = {
        "study": 8,
        "command": common.command_line("server_overhead", argv),
        "quick": args.quick,
        "model": sm.describe(),
        "settings": {
            "reps": reps,
            "prompt_tokens": prompt_tokens["in_process_a"][0],
            "max_tokens": max_tokens,
            "method": "qfilters",
            "budget": budget,
            "n_sink": 4,
            "recent": 0,
            "temperature": 0,
            "eos_banned": True,
            "client": "httpx streaming, SSE parsed on the client",
            "host": common.HOST,
        },
        "completion_tokens": tokens,
        "prompt_tokens_seen": prompt_tokens,
        "ttft_s": {k: summary(v) for k, v in ttft.items()},
        "itl_s": {k: summary(v) for k, v in itl.items()},
        "ttft_ratios": [ratio_row(ttft, a, b) for a, b in pairs],
        "itl_ratios": [ratio_row(itl, a, b) for a, b in pairs],
        "kv_cache_http": runs["http_a"][-1].kv_cache,
    }
    result["plots"] = plot(result, args.out)
    result["runtime_s"] = round(progress.elapsed, 1)
    path = write_json("server_overhead", result, args.out)

    print("\nMedians (IQR); ratios are medians of paired per-round ratios")
    common.print_table(
        ["arm", "TTFT ms", "ITL ms", "tokens"],
        [
            [
                k,
                f"{result['ttft_s'][k]['median'] * 1e3:.1f} ({result['ttft_s'][k]['q1'] * 1e3:.1f}-"
                f"{result['ttft_s'][k]['q3'] * 1e3:.1f})",
                f"{result['itl_s'][k]['median'] * 1e3:.2f} ({result['itl_s'][k]['q1'] * 1e3:.2f}-"
                f"{result['itl_s'][k]['q3'] * 1e3:.2f})",
                tokens[k],
            ]
            for k in runs
        ],
    )
    print()
    common.print_table(
        ["ratio", "TTFT", "ITL"],
        [
            [
                f"{t['arm']} / {t['reference']}",
                f"{t['median']:.3f} [{t['q1']:.2f}-{t['q3']:.2f}]",
                f"{i['median']:.3f} [{i['q1']:.2f}-{i['q3']:.2f}]",
            ]
            for t, i in zip(result["ttft_ratios"], result["itl_ratios"], strict=True)
        ],
    )
    print(f"\nwrote {path} in {result['runtime_s']}s")
    return result


if __name__ == "__main__":
    main()
