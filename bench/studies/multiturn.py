"""Multi-turn chat: time to first token, KV bytes and RSS per turn, with and without reuse
(Q-Filters with and without the prompt cache, a full cache, ``mlx_lm.server``)."""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from bench import clients
from bench.cli import MiB, parse, parser
from bench.clients import rss_bytes
from bench.data import prose_windows
from bench.plots import save_plot, subplots
from bench.report import section, table
from bench.run import open_run
from bench.timing import summary
from qfserve import testing as servers

ARMS = ("qfilters_reuse", "qfilters_fresh", "full_reuse", "theirs")
SERVING = {
    "qfilters_reuse": "reuse",
    "qfilters_fresh": "fresh",
    "full_reuse": "reuse",
    "theirs": "theirs",
}
LAUNCHES = {
    "reuse": ("qfserve",),
    "fresh": ("qfserve", "--prompt-cache-size", "0"),
    "theirs": ("mlx_lm",),
}


def start_servers(
    stack: contextlib.ExitStack,
    folder: Path,
    launches: dict[str, tuple[str, ...]],
    models: dict[str, Path | None] | None = None,
) -> dict[str, servers.ServerProcess]:
    """Each named server (``(kind, *flags)``, qfserve logging warnings only) on ``folder``
    (or the model ``models`` names for it), ready; ``stack`` stops them all as it closes."""
    logs = Path(stack.enter_context(tempfile.TemporaryDirectory()))
    procs: dict[str, servers.ServerProcess] = {}
    stack.callback(lambda: servers.stop_all(list(procs.values()), 10))
    for name, (kind, *flags) in launches.items():
        quiet = {"log_level": "warning"} if kind == "qfserve" else {}
        model = (models or {}).get(name) or folder
        procs[name] = servers.launch(kind, model, *flags, log=logs / f"{name}.log", **quiet)
    for proc in procs.values():
        servers.wait_ready(proc, 180)
    return procs


def chat_turn(client: httpx.Client, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed turn: TTFT on the client, the answer, and the final usage and kv_cache."""
    tic = time.perf_counter()
    ttft, text, usage, kv = None, "", {}, None
    for event in clients.chat_events(client, url, body, timeout=900):
        for choice in event.get("choices") or ():
            piece = (choice.get("delta") or {}).get("content") or ""
            if piece and ttft is None:
                ttft = time.perf_counter() - tic
            text += piece
        usage, kv = event.get("usage") or usage, event.get("kv_cache") or kv
    return {
        "ttft_s": ttft if ttft is not None else time.perf_counter() - tic,
        "answer": text,
        "prompt_tokens": usage.get("prompt_tokens"),
        "completion_tokens": usage.get("completion_tokens"),
        "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
        "kept_bytes": None if kv is None else kv["kept_bytes"],
    }


def plot(result: dict[str, Any], out: Path) -> list[str]:
    fig, axes = subplots(1, 3, figsize=(14, 3.8))
    panels = {
        "ttft_s": ("TTFT (s)", 1, "log"),
        "kept_bytes": ("KV MiB kept (qfserve)", MiB, "linear"),
        "rss_bytes": ("server RSS MiB", MiB, "linear"),
    }
    for ax, (key, (title, scale, yscale)) in zip(axes[0], panels.items(), strict=True):
        for arm, turns in result["turns"].items():
            if None not in (values := [t[key] for t in turns]):  # mlx_lm reports no KV
                ax.plot([t["turn"] for t in turns], [v / scale for v in values], "o-", label=arm)
        ax.set(title=title, xlabel="turn", yscale=yscale)
        ax.legend(fontsize=8)
    return [save_plot(fig, out, "multiturn")]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(
        __doc__,
        file="multiturn",
        reps=1,
        turns=(20, 4),
        turn_tokens=(150, 40),
        max_tokens=(48, 8),
        budget=(512, 64, "Q-Filters budget"),
        conversations=(1, 1, "repeats with other prose"),
    )
    p.add_argument("--arms", nargs="+", choices=ARMS, default=list(ARMS), help="(default all)")
    args = parse(p, argv)
    if args.conversations < 1:
        p.error("--conversations must be >= 1")
    arms = [a for a in ARMS if a in args.arms]
    sm = open_run("multiturn", args, argv)
    tok, n_tokens = sm.tokenizer, args.turn_tokens  # consecutive prose, evenly spaced starts
    conversations = [
        [
            f"Turn {k + 1}. Read on: " + tok.decode(ids[k * n_tokens : (k + 1) * n_tokens].tolist())
            for k in range(args.turns)
        ]
        for ids in prose_windows(tok, n_tokens * args.turns, args.conversations)
    ]
    qfilters = {"kv_method": "qfilters", "qfilters_budget": args.budget}
    extra = {
        "qfilters_reuse": qfilters,
        "qfilters_fresh": qfilters,
        "full_reuse": {"kv_method": "full"},
        "theirs": {},
    }
    runs: list[dict[str, list[dict[str, Any]]]] = []
    with contextlib.ExitStack() as stack:
        needed = sorted({SERVING[a] for a in arms})
        sm.log(f"starting servers: {', '.join(needed)}")
        procs = start_servers(stack, sm.folder, {name: LAUNCHES[name] for name in needed})
        client = stack.enter_context(httpx.Client())
        for c, users in enumerate(conversations):
            history: dict[str, list[dict[str, str]]] = {a: [] for a in arms}
            turns: dict[str, list[dict[str, Any]]] = {a: [] for a in arms}
            for k, user in enumerate(users, start=1):
                for arm in arms:
                    proc = procs[SERVING[arm]]
                    history[arm].append({"role": "user", "content": user})
                    body = {
                        "model": str(sm.folder) if arm == "theirs" else sm.loaded.name,
                        "messages": history[arm],
                        "max_tokens": args.max_tokens,
                        "temperature": 0,
                        **extra[arm],
                    }
                    t = chat_turn(client, proc.url, body)
                    history[arm].append({"role": "assistant", "content": t.pop("answer")})
                    turns[arm].append({**t, "turn": k, "rss_bytes": rss_bytes(proc.pid)})
                sm.log(
                    f"conversation {c + 1}/{len(conversations)}, turn {k}/{args.turns}: "
                    + ", ".join(f"{a} {turns[a][-1]['ttft_s']:.2f}s" for a in arms)
                )
            runs.append(turns)
    # TTFT at the last turn over turn 2's (turn 1 has nothing to reuse)
    by_conversation = {
        a: [None if len(run[a]) < 2 else run[a][-1]["ttft_s"] / run[a][1]["ttft_s"] for run in runs]
        for a in arms
    }
    settings = {
        "turns": args.turns,
        "turn_tokens": args.turn_tokens,
        "max_tokens": args.max_tokens,
        "budget": args.budget,
        "temperature": 0,
        "conversations": len(runs),
        "arms": {a: {"server": SERVING[a], **extra[a]} for a in arms},
        "theirs": "python -m mlx_lm.server (its prompt cache on, full KVCache)",
    }
    result = {
        "settings": settings,
        "turns": runs[0],  # the first conversation
        "runs": runs,
        # Median over conversations (the first one's alone when there is one).
        "last_over_second_ttft": {
            a: None if None in r else summary(r)["median"] for a, r in by_conversation.items()
        },
        "last_over_second_ttft_by_conversation": by_conversation,
    }
    result["plots"] = plot(result, args.out)
    return sm.save(result)


def render(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    intro = (
        f"{s['turns']} turns of about {s['turn_tokens']} new prose tokens each, greedy answers "
        f"of at most {s['max_tokens']} tokens; Q-Filters at budget {s['budget']}."
    )
    arms = list(d["turns"])
    picks = sorted({1, 2, len(d["turns"][arms[0]]) // 2, len(d["turns"][arms[0]])})
    rows = []
    for a in arms:
        for t in d["turns"][a]:
            if t["turn"] in picks:
                cached, kept = t["cached_tokens"], t["kept_bytes"]
                rows.append(
                    [
                        t["turn"],
                        a,
                        t["prompt_tokens"],
                        "—" if cached is None else cached,
                        f"{t['ttft_s']:.2f}",
                        "—" if kept is None else f"{kept / MiB:.1f}",
                        f"{t['rss_bytes'] / MiB:.0f}",
                    ]
                )
    headers = ["turn", "arm", "prompt", "cached", "TTFT s", "KV MiB", "RSS MiB"]
    by_conversation = d.get("last_over_second_ttft_by_conversation", {})
    n = s.get("conversations", 1)

    def ratio(a: str, v: float) -> str:
        each = by_conversation.get(a) or []
        if n < 2 or None in each:
            return f"{a} {v:.2f}×"
        return f"{a} {v:.2f}× (median of {n}; {min(each):.2f}–{max(each):.2f})"

    ratios = ", ".join(ratio(a, v) for a, v in d["last_over_second_ttft"].items() if v is not None)
    where = "in the first conversation " if n > 1 else ""
    picked = f"Rows above: {where}turns 1, 2, the middle and the last."
    last = f"TTFT at the last turn over turn 2: {ratios}."
    title = "Multi-turn chat: reuse of compressed caches"
    return section(title, d, intro, table(headers, rows), picked, last)
