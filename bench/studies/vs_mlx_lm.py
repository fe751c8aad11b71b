"""qfserve against mlx-lm's own server, same model folder, same prompts.

Streamed chat requests, greedy, EOS banned, a unique prefix defeating mlx-lm's prompt cache;
arms interleaved: theirs, ours full, ours with Q-Filters, theirs again (A/A). The same
comparison runs against llama.cpp's server on the GGUF file (:mod:`bench.studies.vs_llama_cpp`);
the other studies that time servers share its requests, rows, table and plot.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
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
    ratios,
    save_plot,
    stream_chat,
    subplots,
    summaries,
)
from bench.report import ms, plots, ratio_cell, speed_header, table
from qfserve import testing as servers

ARMS = ("theirs_a", "ours_full", "ours_qfilters", "theirs_b")
THEIRS = {
    "mlx_lm": "python -m mlx_lm.server (defaults: full KVCache, prompt cache on; defeated by a "
    "unique prompt prefix)",
    "llama_cpp": "python -m llama_cpp.server on the GGUF file (llama-cpp-python, full cache, "
    "float16 KV, 2 threads; n_ctx the model's)",
}
NONCES = itertools.count()  # numbers every request of the process: no two prompts alike
SPEED_HEADERS = ["prompt", "arm", "TTFT ms", "decode tok/s", "TTFT ratio", "tok/s ratio"]


def chat_arm(run: Any, client: httpx.Client, url: str, prompt: int, **body: Any) -> Callable:
    """An arm streaming one greedy chat request of about ``prompt`` tokens to ``url`` with
    ``body``'s fields, EOS banned, its content opened by a new number so that no prompt cache
    can answer it."""
    body = {"temperature": 0, "logit_bias": eos_ban(run), **body}

    def send() -> StreamTiming:
        content = chat_content(run, prompt, f"[{next(NONCES):04d}] ")
        messages = [{"role": "user", "content": content}]
        return stream_chat(client, url, {**body, "messages": messages})

    return send


def per_arm(runs: dict[str, list[StreamTiming]], attr: str) -> dict[str, list[Any]]:
    """Each arm's ``attr`` of its timings, round by round."""
    return {arm: [getattr(t, attr) for t in timings] for arm, timings in runs.items()}


def distinct(runs: dict[str, list[StreamTiming]], attr: str) -> dict[str, list[Any]]:
    """Each arm's distinct values of ``attr`` (one each when every round was alike)."""
    return {arm: sorted(set(values)) for arm, values in per_arm(runs, attr).items()}


def speeds(runs: dict[str, list[StreamTiming]], reference: str) -> dict[str, Any]:
    """TTFT and decode tok/s per arm, and the other arms' paired ratios to ``reference``."""
    ttft, tps = per_arm(runs, "ttft"), per_arm(runs, "decode_tps")
    others = [arm for arm in runs if arm != reference]
    return {"ttft_s": summaries(ttft), "decode_tps": summaries(tps),
            "ttft_ratios": ratios(ttft, reference, others),
            "tps_ratios": ratios(tps, reference, others)}  # fmt: skip


def speed_rows(d: dict[str, Any], tps_digits: int = 0) -> list[list[Any]]:
    """:data:`SPEED_HEADERS` cells of :func:`speeds` rows, per prompt and arm."""
    rows = []
    for r in d["rows"]:
        tr = {x["arm"]: x for x in r["ttft_ratios"]}
        sr = {x["arm"]: x for x in r["tps_ratios"]}
        rows += [[r["prompt_tokens"], a, ms(r["ttft_s"][a], 1e3, 1),
                  ms(r["decode_tps"][a], 1.0, tps_digits), ratio_cell(tr[a]) if a in tr else "—",
                  ratio_cell(sr[a]) if a in sr else "—"] for a in r["ttft_s"]]  # fmt: skip
    return rows


def bars(ax: Any, rows: list[dict[str, Any]], key: str, arms: Any, title: str,
         scale: float = 1.0, style: Callable[[str], dict] = lambda arm: {}) -> None:  # fmt: skip
    """Each arm's median ``key`` (times ``scale``) with its IQR, one bar per arm beside each
    prompt length; ``style(arm)``: the bar's matplotlib options."""
    width = 0.8 / len(arms)
    for i, arm in enumerate(arms):
        med, err = errorbars([r[key][arm] for r in rows])
        x = [j + (i - (len(arms) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(x, [m * scale for m in med], width, yerr=[[e * scale for e in s] for s in err],
               capsize=3, label=arm, **style(arm))  # fmt: skip
    ax.set_xticks(range(len(rows)), [f"prompt {r['prompt_tokens']}" for r in rows])
    ax.set(title=f"{title} (median, IQR)")
    ax.legend(fontsize=8)


def speed_plot(result: dict[str, Any], out: Any, name: str, arms: Any) -> list[str]:
    """TTFT and decode tok/s of :func:`speeds` rows, side by side."""
    fig, axes = subplots(1, 2, figsize=(10, 3.8))
    bars(axes[0, 0], result["rows"], "ttft_s", arms, "TTFT ms", 1e3)
    bars(axes[0, 1], result["rows"], "decode_tps", arms, "decode tokens/s")
    return [save_plot(fig, out, name)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return compare("mlx_lm", "vs_mlx_lm", __doc__, argv)


def compare(kind: str, key: str, doc: str | None, argv: list[str] | None) -> dict[str, Any]:
    """Interleave ``kind``'s server (theirs) and qfserve on the same model and prompts."""
    p = parser(doc, reps=3, max_tokens=(64, 8), budget=(512, 32, "Q-Filters budget"),
               prompts=(None, [64, 200], "prompt tokens (default: 256 and the context - "
                        "max_tokens - 32)"))  # fmt: skip
    args = parse(p, argv)
    sm = open_run(key, args, argv)
    # Long: as close to the context as prompt + max_tokens (+ the nonce) allow.
    lengths = args.prompts or [256, sm.context_length - args.max_tokens - 32]
    # mlx-lm serves the converted folder; llama.cpp the GGUF file, which qfserve then serves too.
    model = sm.folder if kind == "mlx_lm" else servers.gguf_of(args.model)
    qfilters = {"kv_method": "qfilters", "qfilters_budget": args.budget}
    rows = []
    sm.log(f"starting {kind} and qfserve")
    with servers.serve(kind, "qfserve", model=model) as (theirs, ours), httpx.Client() as client:
        mine = {"model": client.get(ours + "/v1/models").json()["data"][0]["id"],
                "max_tokens": args.max_tokens}  # fmt: skip
        sm.log(f"theirs {theirs}, ours {ours}; prompts {lengths}, {args.reps} reps")
        for n in lengths:
            them = chat_arm(sm, client, theirs, n, model=str(model), max_tokens=args.max_tokens)
            arms = {"theirs_a": them,
                    "ours_full": chat_arm(sm, client, ours, n, **mine, kv_method="full"),
                    "ours_qfilters": chat_arm(sm, client, ours, n, **mine, **qfilters),
                    "theirs_b": them}  # fmt: skip
            runs = interleave(arms, args.reps, progress=sm.log.rounds(f"prompt {n}"))
            rows.append({"prompt_tokens": n, "prompt_tokens_seen": distinct(runs, "prompt_tokens"),
                         "completion_tokens": distinct(runs, "completion_tokens"),
                         **speeds(runs, "theirs_a"),
                         "kv_cache_ours_qfilters": runs["ours_qfilters"][-1].kv_cache})  # fmt: skip
    result = {
        "settings": {"reps": args.reps, "max_tokens": args.max_tokens, "budget": args.budget,
                     "n_sink": 4, "recent": args.budget // 4, "temperature": 0,
                     "eos_banned": True, "endpoint": "/v1/chat/completions (stream, include_usage)",
                     "theirs": THEIRS[kind], "model_served": str(model), "host": servers.HOST},
        "rows": rows,
    }  # fmt: skip
    result["plots"] = speed_plot(result, args.out, key, ARMS)
    return sm.save(result)


def render(d: dict[str, Any], title: str = "Against mlx-lm's own server") -> list[str]:
    """This study's section of ``bench/RESULTS.md``."""
    s = d["settings"]
    lines = speed_header(title, d)
    lines += [
        f"Same model folder and prompts, streamed `/v1/chat/completions`, greedy, "
        f"{s['max_tokens']} tokens (EOS banned), {s['reps']} interleaved rounds; theirs: {s['theirs']}; "
        f"ours with Q-Filters at budget {s['budget']}. Ratios to `theirs_a` (`theirs_b` = A/A).",
        "",
    ]
    lines += table(SPEED_HEADERS, speed_rows(d))
    return lines + [*plots(d), ""]
