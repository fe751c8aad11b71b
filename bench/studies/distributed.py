"""One process against the same model split over N ranks (tensor parallelism, the ring
backend on loopback): time to first token, decode tokens/s and the KV bytes one rank holds.

Streamed chat requests, greedy, EOS banned, unique prompts, Q-Filters at ``--budget``; arms
interleaved: one process, N ranks, one process again (A/A). On one machine the ranks share
its cores, so this measures what the lockstep and the collectives cost, not a speed-up: the
point of several ranks is a model larger than one machine. The ranks need heads and MLP units
that divide by N (SmolLM2-135M: 3 KV heads, so 3 ranks; the bundled model: 2).
"""

from __future__ import annotations

import contextlib
import itertools
import tempfile
from pathlib import Path
from typing import Any

import httpx

from bench.data import chat_content, eos_ban
from bench.harness import (
    StreamTiming,
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

ARMS = ("one_a", "ranks", "one_b")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, reps=2, max_tokens=(32, 8), budget=(512, 32, "Q-Filters budget"),
               ranks=(3, 2, "ranks of the split arm"),
               prompts=([2048, 8096], [64], "prompt tokens"))  # fmt: skip
    args = parse(p, argv)
    sm = open_run("distributed", args, argv)
    progress = sm.log
    bias = eos_ban(sm)
    seq = itertools.count()
    extra = {"kv_method": "qfilters", "qfilters_budget": args.budget}

    def arm(client: httpx.Client, url: str, n_prompt: int, name: str):
        def run() -> StreamTiming:
            body = {
                "model": served,
                "messages": [{"role": "user", "content": chat_content(sm, n_prompt, f"[{next(seq):04d}] ")}],
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "logit_bias": bias,
                "stream": True,
                "stream_options": {"include_usage": True},
                **extra,
            }  # fmt: skip
            return stream_chat(client, url, body)

        return run

    rows = []
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="distributed-")))
        progress(f"starting one process and {args.ranks} ranks")
        one = servers.launch("qfserve", sm.folder, log=logs / "one.log", log_level="warning")
        ranks = servers.launch_ranks(args.ranks, sm.folder, "--log-level", "warning", logs=logs)
        stack.callback(servers.stop_all, [one, *ranks], 20)
        for server in (one, ranks[0]):
            servers.wait_ready(server, 600)
        client = stack.enter_context(httpx.Client(timeout=3600))
        served = client.get(one.url + "/v1/models").json()["data"][0]["id"]
        for n in args.prompts:
            arms = {"one_a": arm(client, one.url, n, "one_a"),
                    "ranks": arm(client, ranks[0].url, n, "ranks"),
                    "one_b": arm(client, one.url, n, "one_b")}  # fmt: skip
            runs = interleave(arms, args.reps, progress=progress.rounds(f"prompt {n}"))
            ttft = {k: [t.ttft for t in v] for k, v in runs.items()}
            tps = {k: [t.decode_tps for t in v] for k, v in runs.items()}
            view = client.get(ranks[0].url + "/admin/cache").json()
            rows.append({
                "prompt_tokens": n,
                "ttft_s": summaries(ttft),
                "decode_tps": summaries(tps),
                "ttft_ratios": [ratio_row(ttft, a, "one_a") for a in ARMS[1:]],
                "tps_ratios": [ratio_row(tps, a, "one_a") for a in ARMS[1:]],
                # What one request's caches hold on one rank: rank 0's (the ranks hold equal
                # shares of the heads), and the whole model's in one process.
                "kv_bytes_per_rank": {k: sorted({(t.kv_cache or {}).get("kept_bytes", 0) for t in v})
                                      for k, v in runs.items()},
                "ranks_view": view.get("distributed"),
            })  # fmt: skip
    result = {
        "settings": {"reps": args.reps, "ranks": args.ranks, "max_tokens": args.max_tokens,
                     "budget": args.budget, "backend": "ring on loopback",
                     "endpoint": "/v1/chat/completions (stream, include_usage)"},
        "rows": rows,
    }  # fmt: skip
    result["plots"] = plot(result, args.out)
    return sm.save(result)


def plot(result: dict[str, Any], out: Path) -> list[str]:
    plt = pyplot()
    rows = result["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    labels = [str(r["prompt_tokens"]) for r in rows]
    for ax, key, title in zip(
        axes, ("ttft_s", "decode_tps"), ("TTFT s", "decode tok/s"), strict=True
    ):
        for i, a in enumerate(ARMS):
            ax.bar([j + (i - 1) * 0.25 for j in range(len(rows))],
                   [r[key][a]["median"] for r in rows], 0.25, label=a)  # fmt: skip
        ax.set_xticks(range(len(rows)), labels)
        ax.set_title(title)
        ax.set_xlabel("prompt tokens")
        ax.legend(fontsize=8)
    return [save_plot(fig, out, "distributed")]


def render(d: dict[str, Any]) -> list[str]:
    """This study's section of ``bench/RESULTS.md``."""
    s = d["settings"]
    lines = speed_header(f"One process against {s['ranks']} ranks", d)
    lines.append(
        f"Tensor parallelism over {s['ranks']} ranks ({s['backend']}) against one process, "
        f"streamed chat, greedy, {s['max_tokens']} tokens, Q-Filters at budget {s['budget']}, "
        f"{s['reps']} interleaved rounds; ratios to `one_a` (`one_b` = A/A). The ranks share this "
        "machine's cores: this is the lockstep's overhead, not a speed-up."
    )
    lines.append("")
    rows = []
    for r in d["rows"]:
        tr = {x["arm"]: x for x in r["ttft_ratios"]}
        sr = {x["arm"]: x for x in r["tps_ratios"]}
        for a in ARMS:
            rows.append([
                r["prompt_tokens"], a, ms(r["ttft_s"][a], 1e3, 1), ms(r["decode_tps"][a], 1.0, 1),
                "—" if a == "one_a" else ratio_cell(tr[a]), "—" if a == "one_a" else ratio_cell(sr[a]),
                " / ".join(f"{b / 2**20:.2f}" for b in r["kv_bytes_per_rank"][a]),
            ])  # fmt: skip
    lines += table(["prompt", "arm", "TTFT ms", "decode tok/s", "TTFT ratio", "tok/s ratio",
                    "KV MiB one rank holds"], rows)  # fmt: skip
    return lines + [*plots(d), ""]
