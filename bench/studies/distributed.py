"""One process against the same model split over N ranks (tensor parallelism, ring backend on
loopback): TTFT, decode tok/s and the KV bytes one rank holds. The ranks share this machine's
cores, so this is the lockstep's cost, not a speed-up; heads and MLP units must divide by N."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any

import httpx

from bench.cli import MiB
from bench.report import section, table
from bench.run import start
from bench.studies.vs.vs_mlx_lm import SPEED_HEADERS, chat_arm, speed_plot, speed_rows, speeds
from bench.timing import interleave
from qfserve import testing as servers


def main(argv: list[str] | None = None) -> dict[str, Any]:
    sm = start(
        "distributed",
        argv,
        __doc__,
        reps=2,
        max_tokens=(32, 8),
        budget=(512, 32, "Q-Filters budget"),
        ranks=(3, 2, "ranks of the split arm"),
        prompts=([2048, 8096], [64], "prompt tokens"),
    )
    args, rows = sm.args, []
    with contextlib.ExitStack() as stack:
        logs = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="distributed-")))
        sm.log(f"starting one process and {args.ranks} ranks")
        one = servers.launch("qfserve", sm.folder, log=logs / "one.log", log_level="warning")
        ranks = servers.launch_ranks(args.ranks, sm.folder, "--log-level", "warning", logs=logs)
        stack.callback(servers.stop_all, [one, *ranks], 20)
        for server in (one, ranks[0]):
            servers.wait_ready(server, 600)
        client = stack.enter_context(httpx.Client(timeout=3600))
        body = {
            "model": client.get(one.url + "/v1/models").json()["data"][0]["id"],
            "max_tokens": args.max_tokens,
            "kv_method": "qfilters",
            "qfilters_budget": args.budget,
        }
        for n in args.prompts:
            alone = chat_arm(sm, client, one.url, n, **body)
            arms = {
                "one_a": alone,
                "ranks": chat_arm(sm, client, ranks[0].url, n, **body),
                "one_b": alone,
            }
            runs = interleave(arms, args.reps, progress=sm.log.rounds(f"prompt {n}"))
            # One request's bytes on one rank (rank 0's: the ranks hold equal shares of the
            # heads), and the whole model's in one process.
            held = {
                k: sorted({(t.kv_cache or {}).get("kept_bytes", 0) for t in v})
                for k, v in runs.items()
            }
            view = client.get(ranks[0].url + "/admin/cache").json().get("distributed")
            rows.append(
                {
                    "prompt_tokens": n,
                    **speeds(runs, "one_a"),
                    "kv_bytes_per_rank": held,
                    "ranks_view": view,
                }
            )
    result = {
        "settings": {
            "reps": args.reps,
            "ranks": args.ranks,
            "max_tokens": args.max_tokens,
            "budget": args.budget,
            "backend": "ring on loopback",
            "endpoint": "/v1/chat/completions (stream, include_usage)",
        },
        "rows": rows,
    }
    result["plots"] = speed_plot(result, args.out, "distributed")
    return sm.save(result)


def render(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    intro = (
        f"Tensor parallelism over {s['ranks']} ranks ({s['backend']}) against one process, "
        f"streamed chat, greedy, {s['max_tokens']} tokens, Q-Filters at budget {s['budget']}, "
        f"{s['reps']} interleaved rounds; ratios to `one_a` (`one_b` = A/A). The ranks share this "
        "machine's cores: this is the lockstep's overhead, not a speed-up."
    )
    kv = [
        " / ".join(f"{b / MiB:.2f}" for b in r["kv_bytes_per_rank"][a])
        for r in d["rows"]
        for a in r["ttft_s"]
    ]
    rows = [[*row, held] for row, held in zip(speed_rows(d, tps_digits=1), kv, strict=True)]
    headers = [*SPEED_HEADERS, "KV MiB one rank holds"]
    return section(f"One process against {s['ranks']} ranks", d, intro, table(headers, rows))
