"""qfserve against mlx-lm's own server, same model folder, same prompts.

Streamed chat requests, greedy, EOS banned, a unique prefix defeating mlx-lm's prompt cache;
arms interleaved: theirs, ours full, ours with Q-Filters, theirs again (A/A). The same
comparison runs against llama.cpp's server on the GGUF file (:mod:`bench.studies.vs_llama_cpp`).
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any

import httpx

from bench.data import chat_content, eos_ban
from bench.harness import (
    StreamTiming,
    errorbars,
    interleave,
    open_run,
    parse,
    parser,
    pyplot,
    ratio_row,
    save_plot,
    stream_chat,
    summaries,
)
from bench.report import ms, plots, ratio_cell, speed_header, table
from qfserve import testing as servers

ARMS = ("theirs_a", "ours_full", "ours_qfilters", "theirs_b")


def plot(result, out, name: str = "vs_mlx_lm") -> list[str]:
    plt = pyplot()
    rows = result["rows"]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.8))
    width = 0.2
    for i, arm in enumerate(ARMS):
        x = [j + (i - 1.5) * width for j in range(len(rows))]
        for ax, key, scale in ((a1, "ttft_s", 1e3), (a2, "decode_tps", 1.0)):
            med, err = errorbars([r[key][arm] for r in rows])
            ax.bar(
                x,
                [m * scale for m in med],
                width,
                yerr=[[e * scale for e in s] for s in err],
                capsize=3,
                label=arm,
            )
    labels = [f"prompt {r['prompt_tokens']}" for r in rows]
    a1.set(title="TTFT ms (median, IQR)")
    a2.set(title="decode tokens/s (median, IQR)")
    for ax in (a1, a2):
        ax.set_xticks(range(len(rows)), labels)
        ax.legend(fontsize=8)
    return [save_plot(fig, out, name)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return compare("mlx_lm", "vs_mlx_lm", __doc__, argv)


THEIRS = {
    "mlx_lm": "python -m mlx_lm.server (defaults: full KVCache, prompt cache on; defeated by a "
    "unique prompt prefix)",
    "llama_cpp": "python -m llama_cpp.server on the GGUF file (llama-cpp-python, full cache, "
    "float16 KV, 2 threads; n_ctx the model's)",
}


def compare(kind: str, key: str, doc: str | None, argv: list[str] | None) -> dict[str, Any]:
    """Interleave ``kind``'s server (theirs) and qfserve on the same model and prompts."""
    p = parser(doc, reps=3, max_tokens=(64, 8), budget=(512, 32, "Q-Filters budget"),
               prompts=(None, [64, 200], "prompt tokens (default: 256 and the context - "
                        "max_tokens - 32)"))  # fmt: skip
    args = parse(p, argv)
    reps, max_tokens, budget = args.reps, args.max_tokens, args.budget
    sm = open_run(key, args, argv)
    progress = sm.log
    # Long: as close to the context as prompt + max_tokens (+ the nonce) allow.
    lengths = args.prompts or [256, sm.context_length - max_tokens - 32]
    bias = eos_ban(sm)
    seq = itertools.count()
    # mlx-lm serves the converted folder; llama.cpp the GGUF file, which qfserve then serves too.
    model = sm.folder if kind == "mlx_lm" else servers.gguf_of(args.model)

    def arm(client, url: str, n_prompt: int, name: str, extra: dict):
        def run() -> StreamTiming:
            nonce = f"[{next(seq):04d}-{name[:6]}] "
            body = {
                "model": served if "ours" in name else str(model),
                "messages": [{"role": "user", "content": chat_content(sm, n_prompt, nonce)}],
                "max_tokens": max_tokens,
                "temperature": 0,
                "logit_bias": bias,
                **extra,
            }
            return stream_chat(client, url, body)

        return run

    rows = []
    with contextlib.ExitStack() as stack:
        progress(f"starting {kind} and qfserve")
        theirs, ours = stack.enter_context(servers.serve(kind, "qfserve", model=model))
        client = stack.enter_context(httpx.Client())
        served = client.get(ours + "/v1/models").json()["data"][0]["id"]
        progress(f"theirs {theirs}, ours {ours}; prompts {lengths}, {reps} reps")
        for n in lengths:
            arms = {
                "theirs_a": arm(client, theirs, n, "theirs_a", {}),
                "ours_full": arm(client, ours, n, "ours_full", {"kv_method": "full"}),
                "ours_qfilters": arm(
                    client, ours, n, "ours_qf", {"kv_method": "qfilters", "qfilters_budget": budget}
                ),
                "theirs_b": arm(client, theirs, n, "theirs_b", {}),
            }
            runs = interleave(arms, reps, progress=progress.rounds(f"prompt {n}"))
            ttft = {k: [t.ttft for t in v] for k, v in runs.items()}
            tps = {k: [t.decode_tps for t in v] for k, v in runs.items()}
            rows.append(
                {
                    "prompt_tokens": n,
                    "prompt_tokens_seen": {
                        k: sorted({t.prompt_tokens for t in v}) for k, v in runs.items()
                    },
                    "completion_tokens": {
                        k: sorted({t.completion_tokens for t in v}) for k, v in runs.items()
                    },
                    "ttft_s": summaries(ttft),
                    "decode_tps": summaries(tps),
                    "ttft_ratios": [ratio_row(ttft, a, "theirs_a") for a in ARMS[1:]],
                    "tps_ratios": [ratio_row(tps, a, "theirs_a") for a in ARMS[1:]],
                    "kv_cache_ours_qfilters": runs["ours_qfilters"][-1].kv_cache,
                }
            )
    result = {
        "settings": {
            "reps": reps,
            "max_tokens": max_tokens,
            "budget": budget,
            "n_sink": 4,
            "recent": budget // 4,
            "temperature": 0,
            "eos_banned": True,
            "endpoint": "/v1/chat/completions (stream, include_usage)",
            "theirs": THEIRS[kind],
            "model_served": str(model),
            "host": servers.HOST,
        },
        "rows": rows,
    }
    result["plots"] = plot(result, args.out, key)
    return sm.save(result)


def render(d: dict[str, Any], title: str = "Against mlx-lm's own server") -> list[str]:
    """This study's section of ``bench/RESULTS.md``."""
    s = d["settings"]
    lines = speed_header(title, d)
    lines.append(
        f"Same model folder and prompts, streamed `/v1/chat/completions`, greedy, "
        f"{s['max_tokens']} tokens (EOS banned), {s['reps']} interleaved rounds; theirs: {s['theirs']}; "
        f"ours with Q-Filters at budget {s['budget']}. Ratios to `theirs_a` (`theirs_b` = A/A)."
    )
    lines.append("")
    rows = []
    for r in d["rows"]:
        tr = {x["arm"]: x for x in r["ttft_ratios"]}
        sr = {x["arm"]: x for x in r["tps_ratios"]}
        for a in r["ttft_s"]:
            rows.append(
                [
                    r["prompt_tokens"],
                    a,
                    ms(r["ttft_s"][a], 1e3, 1),
                    ms(r["decode_tps"][a], 1.0, 0),
                    "—" if a == "theirs_a" else ratio_cell(tr[a]),
                    "—" if a == "theirs_a" else ratio_cell(sr[a]),
                ]
            )
    lines += table(["prompt", "arm", "TTFT ms", "decode tok/s", "TTFT ratio", "tok/s ratio"], rows)
    return lines + [*plots(d), ""]
