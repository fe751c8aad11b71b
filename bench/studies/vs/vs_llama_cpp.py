"""qfserve against llama.cpp's server, on the same GGUF file and prompts.

Theirs is llama.cpp's own ``llama-server`` where it is built (``bench/reference/
llama_cpp_tools.sh``, or ``QFSERVE_LLAMA_SERVER``), else llama-cpp-python's server (in this
Python or the one ``QFSERVE_LLAMA_PYTHON`` names); ``--model`` must be a GGUF file or a
catalog model (its GGUF).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import httpx

from bench import clients, plots, timing
from bench.data import chat_content, eos_ban
from bench.report import ms, ratio_cell, section, table
from bench.run import start
from qfserve import testing as servers

THEIRS = {
    "llama_cpp": "python -m llama_cpp.server on the GGUF file (llama-cpp-python, full cache, "
    "float16 KV, 2 threads; n_ctx the model's)",
    "llama_server": "llama.cpp's llama-server on the GGUF file (-c the model's context, -np 1, "
    "full cache, float16 KV, 2 threads)",
}

NONCES = itertools.count()  # numbers every request of the process: no two prompts alike
PANELS = (("ttft_s", 1e3, "TTFT ms"), ("decode_tps", 1.0, "decode tokens/s"))  # key, scale, title
SPEED_HEADERS = ["prompt", "arm", "TTFT ms", "decode tok/s", "TTFT ratio", "tok/s ratio"]


def chat_arm(run: Any, client: httpx.Client, url: str, prompt: int, **body: Any) -> Callable:
    """An arm streaming one greedy chat request of about ``prompt`` tokens to ``url`` with
    ``body``'s fields, EOS banned, its content opened by a new number so that no prompt cache
    can answer it."""
    body = {"temperature": 0, "logit_bias": eos_ban(run), **body}

    def send() -> clients.StreamTiming:
        content = chat_content(run, prompt, f"[{next(NONCES):04d}] ")
        return clients.stream_chat(
            client, url, {**body, "messages": [{"role": "user", "content": content}]}
        )

    return send


def per_arm(runs: dict[str, list[clients.StreamTiming]], attr: str) -> dict[str, list[Any]]:
    """Each arm's ``attr`` of its timings, round by round."""
    return {arm: [getattr(t, attr) for t in timings] for arm, timings in runs.items()}


def distinct(runs: dict[str, list[clients.StreamTiming]], attr: str) -> dict[str, list[Any]]:
    """Each arm's distinct values of ``attr`` (one each when every round was alike)."""
    return {arm: sorted(set(values)) for arm, values in per_arm(runs, attr).items()}


def speeds(runs: dict[str, list[clients.StreamTiming]], reference: str) -> dict[str, Any]:
    """TTFT and decode tok/s per arm, and the other arms' paired ratios to ``reference``."""
    ttft, tps = per_arm(runs, "ttft"), per_arm(runs, "decode_tps")
    others = [arm for arm in runs if arm != reference]
    return {
        "ttft_s": timing.summaries(ttft),
        "decode_tps": timing.summaries(tps),
        "ttft_ratios": timing.ratios(ttft, reference, others),
        "tps_ratios": timing.ratios(tps, reference, others),
    }


def speed_rows(d: dict[str, Any]) -> list[list[Any]]:
    """:data:`SPEED_HEADERS` cells of :func:`speeds` rows, per prompt and arm."""
    rows = []
    for r in d["rows"]:
        tr, sr = ({x["arm"]: ratio_cell(x) for x in r[k]} for k in ("ttft_ratios", "tps_ratios"))
        rows += [
            [
                r["prompt_tokens"],
                a,
                ms(r["ttft_s"][a], 1e3, 1),
                ms(r["decode_tps"][a], 1.0, 0),
                tr.get(a, "—"),
                sr.get(a, "—"),
            ]
            for a in r["ttft_s"]
        ]
    return rows


def speed_plot(result: dict, out: Any, name: str) -> list[str]:
    """TTFT and decode tok/s of :func:`speeds` rows side by side, a group of bars per prompt."""
    groups = [f"prompt {r['prompt_tokens']}" for r in result["rows"]]
    fig, axes = plots.subplots(1, 2, figsize=(10, 3.8))
    for ax, (key, scale, what) in zip(axes[0], PANELS, strict=True):
        stats = [r[key] for r in result["rows"]]
        plots.grouped_bars(ax, groups, stats, f"{what} (median, IQR)", scale)
    return [plots.save_plot(fig, out, name)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Interleave llama.cpp's server (theirs) and qfserve on the same GGUF and prompts."""
    kind = "llama_server" if servers.llama_tool("llama-server") else "llama_cpp"
    sm = start(
        "vs_llama_cpp",
        argv,
        __doc__ or "",
        reps=3,
        max_tokens=(64, 8),
        budget=(512, 32, "Q-Filters budget"),
        prompts=(None, [64, 200], "prompt tokens (default: 256 and the context - max_tokens - 32)"),
    )
    args = sm.args
    # Long: as close to the context as prompt + max_tokens (+ the nonce) allow.
    lengths = args.prompts or [256, sm.context_length - args.max_tokens - 32]
    # llama.cpp serves the GGUF file, which qfserve then serves too.
    model = servers.gguf_of(args.model)
    rows = []
    sm.log(f"starting {kind} and qfserve")
    flags = {"llama_server": ["-c", str(sm.context_length), "-np", "1"]}
    with (
        servers.serve(kind, "qfserve", model=model, flags=flags, timeout=300) as (theirs, ours),
        httpx.Client() as client,
    ):
        mine = {"model": clients.served_model(client, ours), "max_tokens": args.max_tokens}
        sm.log(f"theirs {theirs}, ours {ours}; prompts {lengths}, {args.reps} reps")
        for n in lengths:
            them = chat_arm(sm, client, theirs, n, model=str(model), max_tokens=args.max_tokens)
            arms = {
                "theirs_a": them,
                "ours_full": chat_arm(sm, client, ours, n, **mine, kv_method="full"),
                "ours_qfilters": chat_arm(
                    sm, client, ours, n, **mine, kv_method="qfilters", qfilters_budget=args.budget
                ),
                "theirs_b": them,
            }
            runs = timing.interleave(arms, args.reps, progress=sm.log.rounds(f"prompt {n}"))
            rows.append(
                {
                    "prompt_tokens": n,
                    "prompt_tokens_seen": distinct(runs, "prompt_tokens"),
                    "completion_tokens": distinct(runs, "completion_tokens"),
                    **speeds(runs, "theirs_a"),
                    "kv_cache_ours_qfilters": runs["ours_qfilters"][-1].kv_cache,
                }
            )
    result = {
        "settings": {
            "reps": args.reps,
            "max_tokens": args.max_tokens,
            "budget": args.budget,
            "n_sink": 4,
            "recent": args.budget // 4,
            "temperature": 0,
            "eos_banned": True,
            "endpoint": "/v1/chat/completions (stream, include_usage)",
            "theirs": THEIRS[kind],
            "model_served": str(model),
            "host": servers.HOST,
        },
        "rows": rows,
    }
    result["plots"] = speed_plot(result, args.out, "vs_llama_cpp")
    return sm.save(result)


def render(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    intro = (
        f"Same model folder and prompts, streamed `/v1/chat/completions`, greedy, "
        f"{s['max_tokens']} tokens (EOS banned), {s['reps']} interleaved rounds; theirs: {s['theirs']}; "
        f"ours with Q-Filters at budget {s['budget']}. Ratios to `theirs_a` (`theirs_b` = A/A)."
    )
    return section(
        "Against llama.cpp's server on the same GGUF", d, intro, table(SPEED_HEADERS, speed_rows(d))
    )
