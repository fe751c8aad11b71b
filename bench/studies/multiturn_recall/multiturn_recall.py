"""A pass key given in turn 1, asked for turns later, per cache arm.

A *reuse* arm holds the whole chat in one set of caches (as the prompt cache does); its *fresh*
sibling prefills the reuse arm's transcript afresh at each ask turn.
"""

from __future__ import annotations

import copy
import random
from functools import cache
from typing import Any

import mlx.core as mx
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler

from bench import plots
from bench.arms import make_caches, prefill, token_nll
from bench.data import prose_windows
from bench.report import section, table
from bench.resume import measured, resume
from bench.run import Run, start
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

    def turn(self, messages: list[dict], key: list[int] | None, max_tokens: int) -> dict:
        """The server's prompt for ``messages``: feed what the caches lack of it, score
        ``key`` if asked, then answer."""
        model, tok = self.sm.model, self.sm.tokenizer
        request = GenerationRequest(
            kind="chat",
            messages=tuple(messages),
            sampling=SamplingParams(temperature=0.0),
            cache=CacheConfig(),
        )
        prompt = encode_prompt(self.sm.loaded, request)[0]
        reused = len(self.held) if self.held and prompt[: len(self.held)] == self.held else 0
        self.misses += bool(self.held) and not reused
        if not reused:
            filters = self.sm.filters if self.config.method == "qfilters" else None
            self.caches = make_caches(model, self.config, filters=filters)
        prefill(model, self.caches, prompt[reused:-1], chunk=DEFAULT_PREFILL_CHUNK)
        key_nll = None
        if key is not None:  # on a copy: the conversation goes on from the unscored caches
            logits = model(mx.array([[prompt[-1], *key[:-1]]]), cache=copy.deepcopy(self.caches))
            key_nll = float(token_nll(logits, mx.array([key])).mean())
        tokens = [
            g.token
            for g in stream_generate(
                model,
                tok,
                prompt[-1:],
                max_tokens=max_tokens,
                sampler=make_sampler(0.0),
                prompt_cache=self.caches,
            )
        ]
        # stream_generate feeds each token it returns, the last (EOS included) too.
        self.held = [*prompt, *tokens]
        eos = set(tok.eos_token_ids)
        kept = [c.size() for c in self.caches if hasattr(c, "size")]
        return {
            "answer": tok.decode([t for t in tokens if t not in eos]),
            "prompt_tokens": len(prompt),
            "cached_tokens": reused,
            "completion_tokens": len(tokens),
            "tokens_kept": max(kept),
            "key_nll": key_nll,
        }


def history(users: list[str], answers: list[str], k: int) -> list[dict[str, str]]:
    """The messages up to user turn ``k`` (1-based), with ``answers`` to the earlier ones."""
    out = []
    for user, said in zip(users[: k - 1], answers, strict=False):
        out += [{"role": "user", "content": user}, {"role": "assistant", "content": said}]
    return [*out, {"role": "user", "content": users[k - 1]}]


def plot(accuracy: dict, key_nll: dict, out: Any) -> list[str]:
    names = list(accuracy)
    fig, axes = plots.subplots(1, 2, figsize=(max(10, 1.2 * len(names)), 4))
    for ax, values, title in (
        (axes[0, 0], accuracy, "pass key from turn 1: accuracy"),
        (axes[0, 1], key_nll, "the key's NLL as the answer (nats/token)"),
    ):
        by_ask = [{f"asked at turn {k}": v for k, v in values[n].items()} for n in names]
        plots.grouped_bars(ax, names, by_ask, title)
        ax.set_xticks(range(len(names)), names, rotation=40, ha="right", fontsize=8)
    axes[0, 0].set_ylim(0, 1.05)
    return [plots.save_plot(fig, out, STUDY)]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    methods = ["qfilters", "knorm", "streaming"]
    sm = start(
        STUDY,
        argv,
        __doc__,
        turns=(20, 4),
        ask=([5, 10, 20], [2, 4]),
        budgets=([256, 512], [64]),
        methods=(methods, methods),
        conversations=1,
        turn_tokens=(150, 40),
        max_tokens=(24, 8),
    )
    args = sm.args
    ask, n_conv, max_tokens = sorted(set(args.ask)), args.conversations, args.max_tokens
    tok = sm.tokenizer
    configs = arms(args.budgets, args.methods)
    rng = random.Random(args.seed)
    keys = [f"{rng.randrange(10_000, 100_000)}" for _ in range(n_conv)]

    @cache
    def users(c: int) -> list[str]:
        return user_messages(tok, keys[c], args.turns, set(ask), args.turn_tokens, 997 * c)

    def measure(c: int, name: str) -> dict[str, Any]:
        (config, reuse), key = configs[name], list(tok.encode(keys[c], add_special_tokens=False))
        chat, answers, turns = Chat(sm, config), [], []
        if reuse:  # the whole conversation in one set of caches
            for k in range(1, args.turns + 1):
                turn = chat.turn(
                    history(users(c), answers, k), key if k in ask else None, max_tokens
                )
                answers.append(turn["answer"])
                turns.append({"turn": k, **turn})
        else:  # at each ask turn, the reuse arm's transcript up to it, prefilled afresh
            sibling = done[(c, name.replace("/fresh", "/reuse"))]
            if sibling["key"] != keys[c]:
                raise RuntimeError(f"{name}: the logged reuse arm asked another key")
            answers = [t["answer"] for t in sibling["turns"]]
            turns = [
                {"turn": k, **Chat(sm, config).turn(history(users(c), answers, k), key, max_tokens)}
                for k in ask
            ]
        by_turn = {t["turn"]: t for t in turns}
        return {
            "conversation": c,
            "arm": name,
            "key": keys[c],
            "settings": design,
            "turns": turns,
            "misses": chat.misses,
            "right": [keys[c] in by_turn[k]["answer"] for k in ask],
            "key_nll": [by_turn[k]["key_nll"] for k in ask],
        }

    log = args.out / f"{STUDY}.jsonl"
    # Rows are read back only for the same design, sizes, seed (the keys and texts) and model.
    design = [
        args.turns,
        ask,
        args.turn_tokens,
        max_tokens,
        SETTINGS_TAG,
        args.seed,
        sm.identity["weights_sha1"],
    ]
    done = resume(
        log, lambda r: (r["conversation"], r["arm"]), keep=lambda r: r["settings"] == design
    )
    rows = measured(log, done, [(c, n) for c in range(n_conv) for n in configs], measure, "arms")
    by_arm = {name: [r for r in rows if r["arm"] == name] for name in configs}

    def per_ask(field: str) -> dict[str, dict[int, float]]:
        """``field``'s mean over the conversations at each ask turn, per arm."""
        return {
            name: {k: sum(r[field][i] for r in rs) / n_conv for i, k in enumerate(ask)}
            for name, rs in by_arm.items()
        }

    accuracy, key_nll = per_ask("right"), per_ask("key_nll")
    settings = {
        "turns": args.turns,
        "ask": ask,
        "turn_tokens": args.turn_tokens,
        "max_tokens": max_tokens,
        "conversations": n_conv,
        "budgets": args.budgets,
        "methods": args.methods,
        "recent": "budget/4 (streaming: 0)",
        "fresh": "the reuse arm's transcript, prefilled whole at each ask turn",
        "prefill_chunk": DEFAULT_PREFILL_CHUNK,
        "temperature": 0,
    }
    # Turns that continued the caches, and turns that could not (a reply that does not
    # tokenise back the same: that turn prefilled the whole history instead).
    hits = {
        n: sum(t["cached_tokens"] > 0 for r in rs for t in r["turns"]) for n, rs in by_arm.items()
    }
    return sm.save(
        {
            "settings": settings,
            "accuracy": accuracy,
            "key_nll": key_nll,
            "reuse_hits": hits,
            "reuse_misses": {n: sum(r["misses"] for r in rs) for n, rs in by_arm.items()},
            "plots": plot(accuracy, key_nll, args.out),
            "rows": rows,
        },
        model=sm.describe(),
    )


def render(data: dict[str, Any]) -> list[str]:
    st, ask = data["settings"], data["settings"]["ask"]
    intro = (
        f"{st['conversations']} conversation(s) of {st['turns']} turns ({st['turn_tokens']} "
        f"prose tokens each, greedy answers of up to {st['max_tokens']} tokens); the key asked "
        f"at turns {', '.join(map(str, ask))}; recent {st['recent']}. Reuse: one set of caches "
        f"for the whole chat; fresh: {st['fresh']}. Each cell: accuracy / the key's mean NLL "
        "as the answer (nats per token, teacher-forced)."
    )
    rows = [
        [
            name,
            *[
                f"{data['accuracy'][name][str(k)]:.2f} / {data['key_nll'][name][str(k)]:.2f}"
                for k in ask
            ],
            data["reuse_hits"][name],
            data["reuse_misses"][name],
        ]
        for name in data["accuracy"]
    ]
    headers = ["arm", *[f"turn {k}" for k in ask], "turns reused", "misses"]
    return section("A pass key from turn 1, asked turns later", data, intro, table(headers, rows))
