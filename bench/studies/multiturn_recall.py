"""A pass key given in turn 1, asked for turns later, per cache arm.

Each user turn adds prose and asks either for the key or for a summary; greedy answers join
the history. At an ask: whether the answer holds the key, and the key's NLL as the answer
(teacher-forced on a copy of the caches). A *reuse* arm holds the whole chat in one set of
caches (as the server's prompt cache does); its *fresh* sibling prefills the reuse arm's
transcript afresh at each ask turn.
"""

from __future__ import annotations

import copy
import random
from typing import Any

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler

from bench.arms import make_caches, prefill, token_nll
from bench.data import prose_windows
from bench.harness import Run, append_jsonl, open_run, parse, parser, resume, save_plot, subplots
from bench.report import plots, quality_header, table
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.serving.config import DEFAULT_PREFILL_CHUNK
from qfserve.engine.text.prompts import encode_prompt
from qfserve.engine.text.requests import GenerationRequest, SamplingParams

STUDY = "multiturn_recall"
ASK = "What is the pass key I gave you in my first message? Answer with the number only."
SUMMARY = "Summarise this part in one sentence."
SETTINGS_TAG = "in process, key NLL"  # log lines of another design are not read back


def arms(budgets: list[int], methods: list[str]) -> dict[str, tuple[CacheConfig, bool]]:
    """Name -> (cache settings, reuse): the full cache, then each method at each budget."""
    out = {"full/reuse": (CacheConfig(method="full"), True)}
    for budget in budgets:
        for method in methods:
            recent = 0 if method == "streaming" else budget // 4
            config = CacheConfig(method=method, budget=budget, recent=recent)  # type: ignore[arg-type]
            out[f"{method}/b{budget}/reuse"] = (config, True)
            out[f"{method}/b{budget}/fresh"] = (config, False)
    return out


def user_messages(tok: Any, key: str, turns: int, ask: set[int], n: int, start: int) -> list[str]:
    """``turns`` messages of ``n`` prose tokens each, from token ``start`` of the prose on: the
    first gives the key, each ends asking for it (turns in ``ask``) or for a summary."""
    (ids,) = prose_windows(tok, n * turns + start, 1)
    ids = ids[start:]
    remember = f"Remember this pass key: {key}. I will ask you about it later.\n\n"
    out = []
    for k in range(1, turns + 1):
        text = tok.decode(ids[(k - 1) * n : k * n].tolist())
        out.append(f"{remember if k == 1 else ''}{text}\n\n{ASK if k in ask else SUMMARY}")
    return out


class Chat:
    """One arm's caches and the tokens they hold."""

    def __init__(self, sm: Run, config: CacheConfig) -> None:
        self.sm, self.config = sm, config
        self.caches: list[Any] = []
        self.held: list[int] = []
        self.misses = 0

    def _reset(self) -> None:
        filters = self.sm.filters if self.config.method == "qfilters" else None
        self.caches = make_caches(self.sm.model, self.config, filters=filters)
        self.held = []

    def turn(self, prompt: list[int], key: list[int] | None, max_tokens: int) -> dict[str, Any]:
        """Feed what the caches lack of ``prompt``, score ``key`` if asked, then answer."""
        reused = 0
        if self.held and prompt[: len(self.held)] == self.held:
            reused = len(self.held)
        elif self.held:
            self.misses += 1
        if not reused:
            self._reset()
        model, tok = self.sm.model, self.sm.tokenizer
        prefill(model, self.caches, prompt[reused:-1], chunk=DEFAULT_PREFILL_CHUNK)
        key_nll = None
        if key is not None:  # on a copy: the conversation goes on from the unscored caches
            scored = copy.deepcopy(self.caches)
            logits = model(mx.array([[prompt[-1], *key[:-1]]]), cache=scored)
            key_nll = float(token_nll(logits, mx.array([key])).mean())
        greedy = make_sampler(0.0)
        generated = stream_generate(
            model, tok, prompt[-1:], max_tokens=max_tokens, sampler=greedy, prompt_cache=self.caches
        )
        tokens = [g.token for g in generated]
        # stream_generate feeds each token it returns, the last (EOS included) too.
        self.held = [*prompt, *tokens]
        eos = set(tok.eos_token_ids)
        kept = [c.size() for c in self.caches if hasattr(c, "size")]
        return {"answer": tok.decode([t for t in tokens if t not in eos]),
                "prompt_tokens": len(prompt), "cached_tokens": reused,
                "completion_tokens": len(tokens), "tokens_kept": max(kept), "key_nll": key_nll}  # fmt: skip


def chat_prompt(sm: Run, history: list[dict[str, str]]) -> list[int]:
    """The prompt the server would build for these messages."""
    request = GenerationRequest(kind="chat", messages=tuple(history),
                                sampling=SamplingParams(temperature=0.0), cache=CacheConfig())  # fmt: skip
    return encode_prompt(sm.loaded, request)[0]


def converse(sm, config, users, key, ask, max_tokens) -> tuple[list[dict[str, Any]], int]:
    """The whole conversation in one set of caches; per turn its record, and the misses."""
    chat, history, turns = Chat(sm, config), [], []
    for k, user in enumerate(users, 1):
        history.append({"role": "user", "content": user})
        turn = chat.turn(chat_prompt(sm, history), key if k in ask else None, max_tokens)
        history.append({"role": "assistant", "content": turn["answer"]})
        turns.append({"turn": k, **turn})
    return turns, chat.misses


def ask_fresh(sm, config, users, transcript, key, ask, max_tokens) -> list[dict[str, Any]]:
    """At each ask turn, the reuse arm's transcript up to it, prefilled afresh."""
    turns = []
    for k in ask:
        history: list[dict[str, str]] = []
        for user, said in zip(users[: k - 1], transcript[: k - 1], strict=True):
            history += [{"role": "user", "content": user},
                        {"role": "assistant", "content": said["answer"]}]  # fmt: skip
        history.append({"role": "user", "content": users[k - 1]})
        turn = Chat(sm, config).turn(chat_prompt(sm, history), key, max_tokens)
        turns.append({"turn": k, **turn})
    return turns


def plot(accuracy: dict, key_nll: dict, out: Any) -> list[str]:
    names = list(accuracy)
    asks = sorted(next(iter(accuracy.values())))
    width = 0.8 / len(asks)
    fig, axes = subplots(1, 2, figsize=(max(10, 1.2 * len(names)), 4))
    for ax, values, title in ((axes[0, 0], accuracy, "pass key from turn 1: accuracy"),
                              (axes[0, 1], key_nll, "the key's NLL as the answer (nats/token)")):  # fmt: skip
        for i, k in enumerate(asks):
            x = [j + (i - (len(asks) - 1) / 2) * width for j in range(len(names))]
            ax.bar(x, [values[n][k] for n in names], width, label=f"asked at turn {k}")
        ax.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=8)
        ax.set(title=title)
        ax.legend(fontsize=8)
    axes[0, 0].set_ylim(0, 1.05)
    return [save_plot(fig, out, STUDY)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    methods = ["qfilters", "knorm", "streaming"]
    p = parser(__doc__, turns=(20, 4), ask=([5, 10, 20], [2, 4]), budgets=([256, 512], [64]),
               methods=(methods, methods), conversations=1, turn_tokens=(150, 40),
               max_tokens=(24, 8))  # fmt: skip
    args = parse(p, argv)
    ask, n_conv, max_tokens = sorted(set(args.ask)), args.conversations, args.max_tokens
    sm = open_run(STUDY, args, argv)
    tok = sm.tokenizer
    configs = arms(args.budgets, args.methods)
    log = args.out / f"{STUDY}.jsonl"
    # Rows are read back only for the same design, sizes, seed (the keys and texts) and model.
    design = [args.turns, ask, args.turn_tokens, max_tokens, SETTINGS_TAG, args.seed,
              sm.identity["weights_sha1"]]  # fmt: skip
    done = resume(
        log, lambda r: (r["conversation"], r["arm"]), keep=lambda r: r["settings"] == design
    )
    rng = random.Random(args.seed)
    for c in range(n_conv):
        key = f"{rng.randrange(10_000, 100_000)}"
        key_ids = list(tok.encode(key, add_special_tokens=False))
        users = user_messages(tok, key, args.turns, set(ask), args.turn_tokens, 997 * c)
        for name, (config, reuse) in configs.items():
            if (c, name) in done:
                continue
            misses = 0
            if reuse:
                turns, misses = converse(sm, config, users, key_ids, ask, max_tokens)
            else:
                sibling = done[(c, name.replace("/fresh", "/reuse"))]
                if sibling["key"] != key:
                    raise RuntimeError(f"{name}: the logged reuse arm asked another key")
                turns = ask_fresh(sm, config, users, sibling["turns"], key_ids, ask, max_tokens)
            by_turn = {t["turn"]: t for t in turns}
            row = {"conversation": c, "arm": name, "key": key, "settings": design,
                   "turns": turns, "misses": misses,
                   "right": [key in by_turn[k]["answer"] for k in ask],
                   "key_nll": [by_turn[k]["key_nll"] for k in ask]}  # fmt: skip
            done[(c, name)] = row
            append_jsonl(log, row)
            sm.log(f"conversation {c + 1}, {name}: right {row['right']}, key NLL "
                   f"{[round(x, 2) for x in row['key_nll']]}")  # fmt: skip
    by_arm = {name: [done[(c, name)] for c in range(n_conv)] for name in configs}

    def per_ask(field: str) -> dict[str, dict[int, float]]:
        """``field``'s mean over the conversations at each ask turn, per arm."""
        return {name: {k: sum(r[field][i] for r in rows) / n_conv for i, k in enumerate(ask)}
                for name, rows in by_arm.items()}  # fmt: skip

    accuracy, key_nll = per_ask("right"), per_ask("key_nll")
    settings = {"turns": args.turns, "ask": ask, "turn_tokens": args.turn_tokens,
                "max_tokens": max_tokens, "conversations": n_conv, "budgets": args.budgets,
                "methods": args.methods, "recent": "budget/4 (streaming: 0)",
                "fresh": "the reuse arm's transcript, prefilled whole at each ask turn",
                "prefill_chunk": DEFAULT_PREFILL_CHUNK, "temperature": 0}  # fmt: skip
    results = {
        "settings": settings,
        "accuracy": accuracy,
        "key_nll": key_nll,
        # Turns that continued the caches, and turns that could not (a reply that does not
        # tokenise back the same: that turn prefilled the whole history instead).
        "reuse_hits": {
            name: sum(t["cached_tokens"] > 0 for r in rows for t in r["turns"])
            for name, rows in by_arm.items()
        },
        "reuse_misses": {name: sum(r["misses"] for r in rows) for name, rows in by_arm.items()},
        "plots": plot(accuracy, key_nll, args.out),
        "rows": [done[(c, name)] for c in range(n_conv) for name in configs],
    }
    return sm.save(results, model=sm.describe())


def render(data: dict[str, Any]) -> list[str]:
    """This study's section of ``bench/RESULTS.md``."""
    lines = quality_header("A pass key from turn 1, asked turns later", data)
    st, ask = data["settings"], data["settings"]["ask"]
    lines += [
        "",
        f"{st['conversations']} conversation(s) of {st['turns']} turns ({st['turn_tokens']} prose "
        f"tokens each, greedy answers of up to {st['max_tokens']} tokens); the key asked at turns "
        f"{', '.join(map(str, ask))}; recent {st['recent']}. Reuse: one set of caches for the "
        f"whole chat; fresh: {st['fresh']}. Each cell: accuracy / the key's mean NLL as the "
        "answer (nats per token, teacher-forced).",
        "",
    ]
    rows = [[name, *[f"{data['accuracy'][name][str(k)]:.2f} / {data['key_nll'][name][str(k)]:.2f}"
                     for k in ask], data["reuse_hits"][name], data["reuse_misses"][name]]
            for name in data["accuracy"]]  # fmt: skip
    lines += table(["arm", *[f"turn {k}" for k in ask], "turns reused", "misses"], rows)
    return lines + plots(data)
