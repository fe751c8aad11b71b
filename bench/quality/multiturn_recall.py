"""A pass key given in turn 1 of a chat, asked again turns later, with and without reuse.

Each conversation opens with "Remember this pass key: <5 digits>." and then, turn after turn,
about ``--turn-tokens`` tokens of English prose (:mod:`bench.quality.prose`); at the turns in
``--ask`` the user asks for the pass key, at the others for a one-line summary. The model
answers greedily (at most ``--max-tokens``, ending where it ends) and each answer joins that
conversation's history, as a chat client would send it. An ask is right when the answer
contains the key.

Arms: the full cache (the reference), and Q-Filters, K-norm (recent window budget/4) and
streaming at each budget. A *reuse* arm holds the whole conversation, each turn continuing its
previous turn's cache: turn N attends to the history as it was compressed turn by turn. Its
*fresh* sibling asks the same question on the same text without reuse: at each ask turn it
prefills the reuse arm's transcript up to that turn in one go (the history compressed at once)
and answers. The two therefore differ only in how the cache was built, not in what the model
said along the way. Everything runs through the server's own worker in process (calibrated
filters from the registry, continuous batching: the arms' conversations advance together).

Each arm's conversation is appended to ``<out>/multiturn_recall.jsonl`` as soon as it ends,
so an interrupted run resumes; ``<out>/multiturn_recall.json`` is written at the end.

Cost: a reuse arm prefills each turn's new tokens once; a fresh arm prefills the history once
per ask turn. At the default size (20 turns of 150 tokens, asks at 5, 10 and 20, budgets 256
and 512, three methods) that is about 60k prompt tokens per conversation.

Run: ``python -m bench.quality.multiturn_recall [--quick] [--turns 20] [--ask 5 10 20]``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

from bench.cli import command_line, parse, parser
from bench.harness import print_table, write_results
from bench.quality.prose import prose_windows
from bench.speed import common
from engine.config import CacheConfig
from engine.requests import Delta, Failed, Finished, GenerationRequest, SamplingParams
from engine.worker import Worker

STUDY = "multiturn_recall"
ASK = "What is the pass key I gave you in my first message? Answer with the number only."
SUMMARY = "Summarise this part in one sentence."


def arms(budgets: list[int], methods: list[str]) -> dict[str, tuple[CacheConfig, bool]]:
    """Name -> (cache settings, reuse)."""
    out = {"full/reuse": (CacheConfig(method="full"), True)}
    for budget in budgets:
        for method in methods:
            recent = 0 if method == "streaming" else budget // 4
            config = CacheConfig(method=method, budget=budget, recent=recent)  # type: ignore[arg-type]
            for reuse in (True, False):
                out[f"{method}/b{budget}/{'reuse' if reuse else 'fresh'}"] = (config, reuse)
    return out


def user_messages(tok: Any, key: str, turns: int, ask: set[int], n: int, start: int) -> list[str]:
    (ids,) = prose_windows(tok, n * turns + start, 1)
    ids = ids[start:]
    out = []
    for k in range(1, turns + 1):
        text = tok.decode(ids[(k - 1) * n : k * n].tolist())
        head = (
            f"Remember this pass key: {key}. I will ask you about it later.\n\n" if k == 1 else ""
        )
        out.append(f"{head}{text}\n\n{ASK if k in ask else SUMMARY}")
    return out


async def answer(
    worker: Worker, config: CacheConfig, reuse: bool, history: list[dict[str, str]], n: int
) -> dict[str, Any]:
    """One request: the answer, its prompt and cached tokens, and the KV rows kept."""
    job = worker.submit(
        GenerationRequest(
            kind="chat",
            messages=tuple(history),
            sampling=SamplingParams(max_tokens=n, temperature=0.0),
            cache=config,
            reuse=reuse,
        ),
        asyncio.get_running_loop(),
    )
    text = ""
    while True:
        event = await job.next_event()
        if isinstance(event, Delta):
            text += event.text
        elif isinstance(event, Failed):
            raise RuntimeError(f"{config.method}: {event.kind}: {event.message}")
        elif isinstance(event, Finished):
            return {
                "answer": text,
                "prompt_tokens": event.prompt_tokens,
                "cached_tokens": event.cached_tokens,
                "tokens_kept": event.kv_cache["tokens_kept"],
            }


async def converse(
    worker: Worker, config: CacheConfig, users: list[str], max_tokens: int
) -> list[dict[str, Any]]:
    """The whole conversation, each turn reusing the previous turn's cache."""
    history: list[dict[str, str]] = []
    turns = []
    for k, user in enumerate(users, 1):
        history.append({"role": "user", "content": user})
        turn = {"turn": k, **await answer(worker, config, True, history, max_tokens)}
        history.append({"role": "assistant", "content": turn["answer"]})
        turns.append(turn)
    return turns


async def ask_fresh(
    worker: Worker,
    config: CacheConfig,
    users: list[str],
    transcript: list[dict[str, Any]],
    ask: list[int],
    max_tokens: int,
) -> list[dict[str, Any]]:
    """At each ask turn, the reuse arm's transcript up to it, prefilled without reuse."""
    turns = []
    for k in ask:
        history = []
        for user, said in zip(users[: k - 1], transcript[: k - 1], strict=True):
            history += [{"role": "user", "content": user},
                        {"role": "assistant", "content": said["answer"]}]  # fmt: skip
        history.append({"role": "user", "content": users[k - 1]})
        turn = {"turn": k, **await answer(worker, config, False, history, max_tokens)}
        if turn["prompt_tokens"] != transcript[k - 1]["prompt_tokens"]:
            # The same messages must render to the same prompt, or the arms are not comparable.
            raise RuntimeError(f"turn {k}: the fresh prompt differs from the reused one")
        turns.append(turn)
    return turns


def plot(accuracy: dict[str, dict[int, float]], out: Any) -> list[str]:
    plt = common.plt()
    names = list(accuracy)
    asks = sorted(next(iter(accuracy.values())))
    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(names)), 3.8))
    width = 0.8 / len(asks)
    for i, k in enumerate(asks):
        x = [j + (i - (len(asks) - 1) / 2) * width for j in range(len(names))]
        ax.bar(x, [accuracy[n][k] for n in names], width, label=f"asked at turn {k}")
    ax.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=8)
    ax.set(title="pass key from turn 1: accuracy", ylim=(0, 1.05))
    ax.legend(fontsize=8)
    fig.tight_layout()
    return [common.save_figure(fig, out, STUDY)]


def main(argv=None) -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--turns", type=int, default=None, help="(default 20; quick 4)")
    p.add_argument("--ask", type=int, nargs="+", default=None, help="(default 5 10 20)")
    p.add_argument("--budgets", type=int, nargs="+", default=None, help="(default 256 512)")
    p.add_argument("--methods", nargs="+", default=None, help="(default qfilters knorm streaming)")
    p.add_argument("--conversations", type=int, default=None, help="(default 2; quick 1)")
    p.add_argument("--turn-tokens", type=int, default=None, help="(default 150; quick 40)")
    p.add_argument("--max-tokens", type=int, default=None, help="(default 24; quick 8)")
    args = parse(p, argv)
    quick = args.quick
    n_turns = args.turns or (4 if quick else 20)
    ask = set(args.ask or ([2, 4] if quick else [5, 10, 20]))
    budgets = args.budgets or ([64] if quick else [256, 512])
    methods = args.methods or ["qfilters", "knorm", "streaming"]
    n_conv = args.conversations or (1 if quick else 2)
    turn_tokens = args.turn_tokens or (40 if quick else 150)
    max_tokens = args.max_tokens or (8 if quick else 24)
    started = time.perf_counter()
    sm = common.load_study_model(args.model)
    table = arms(budgets, methods)
    args.out.mkdir(parents=True, exist_ok=True)
    log = args.out / f"{STUDY}.jsonl"
    settings = [n_turns, sorted(ask), turn_tokens, max_tokens, "fresh at the asks"]
    done = {}
    if log.exists():
        for line in log.read_text().splitlines():
            row = json.loads(line)
            if row["settings"] == settings:
                done[(row["conversation"], row["arm"])] = row
    worker = Worker(str(sm.path), loader=lambda _ref: sm.loaded, max_batch=len(table))
    worker.start()
    while not worker.ready:
        if worker.status not in ("loading", "ready"):
            raise RuntimeError(f"worker: {worker.status}: {worker.error}")
        time.sleep(0.05)
    rng = random.Random(args.seed)
    try:
        for c in range(n_conv):
            key = f"{rng.randrange(10_000, 100_000)}"
            users = user_messages(sm.loaded.tokenizer, key, n_turns, ask, turn_tokens, 997 * c)

            def log_row(name, turns, c=c, key=key):
                # Logged as soon as the arm ends: a stopped run keeps what it finished.
                by_turn = {t["turn"]: t for t in turns}
                row = {"conversation": c, "arm": name, "key": key, "settings": settings,
                       "turns": turns,
                       "right": [key in by_turn[k]["answer"] for k in sorted(ask)]}  # fmt: skip
                done[(c, name)] = row
                with log.open("a") as f:
                    f.write(json.dumps(row) + "\n")

            async def pair(name, cfg, c=c, users=users):
                if (c, name) not in done:
                    log_row(name, await converse(worker, cfg, users, max_tokens))
                sibling = name.replace("/reuse", "/fresh")
                if sibling in table and (c, sibling) not in done:
                    transcript = done[(c, name)]["turns"]
                    turns = await ask_fresh(worker, cfg, users, transcript, sorted(ask),
                                            max_tokens)  # fmt: skip
                    log_row(sibling, turns)

            todo = [name for name in table if name.endswith("/reuse")
                    and any((c, n) not in done for n in (name, name.replace("/reuse", "/fresh")))]  # fmt: skip

            async def run_all(todo=todo):
                await asyncio.gather(*(pair(name, table[name][0]) for name in todo))

            if todo:
                asyncio.run(run_all())
            print(f"conversation {c + 1}/{n_conv} done ({time.perf_counter() - started:.0f}s)")
    finally:
        worker.stop()
    accuracy = {
        name: {
            k: sum(done[(c, name)]["right"][i] for c in range(n_conv)) / n_conv
            for i, k in enumerate(sorted(ask))
        }
        for name in table
    }
    results = {
        "command": command_line("bench.quality.multiturn_recall", argv),
        "quick": quick,
        "model": sm.describe(),
        "settings": {
            "turns": n_turns,
            "ask": sorted(ask),
            "turn_tokens": turn_tokens,
            "max_tokens": max_tokens,
            "conversations": n_conv,
            "budgets": budgets,
            "methods": methods,
            "recent": "budget/4 (streaming: 0)",
            "fresh": "the reuse arm's transcript, prefilled whole at each ask turn",
            "temperature": 0,
        },  # fmt: skip
        "accuracy": accuracy,
        # Turns that continued a cached conversation (a reply that does not tokenise back
        # the same is a counted miss, and that turn prefills the whole history instead).
        "reuse_hits": {
            name: sum(
                t["cached_tokens"] > 0 for c in range(n_conv) for t in done[(c, name)]["turns"]
            )
            for name in table
        },
        "plots": plot(accuracy, args.out),
        "rows": [done[(c, name)] for c in range(n_conv) for name in table],
    }
    path = write_results(STUDY, results, args.out, section="quality", started=started)
    hits = results["reuse_hits"]
    print_table(
        ["arm", *[f"turn {k}" for k in sorted(ask)], "turns reused"],
        [[name, *[f"{accuracy[name][k]:.2f}" for k in sorted(ask)], hits[name]] for name in table],
    )
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
