"""Five questions on one document in five later turns, through the server's own prompt cache.

Each later turn asks for one fact, continuing the previous prompt through a ``Worker`` with
reuse on: later questions read what was kept without knowing them.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import numpy as np

from bench import clients
from bench.arms import Arm
from bench.data import CITIES, first_number_is, prose_run
from bench.plots import COLORS, accuracy_plot
from bench.report import accuracy_table, arm_label, section
from bench.run import start
from qfserve.calibrations.registry import find_surrogate, model_id_for
from qfserve.engine.text.requests import Delta, GenerationRequest, SamplingParams

STUDY = "kvzip_reuse"
FACTS = 5
ARMS = {
    a.name: a
    for a in (
        Arm("full"),
        Arm("qfilters", 0.25),
        Arm("snapkv", 0.25),
        Arm("streaming", 0.0),
        Arm("kvzip", 0.25, shared=True),
    )
}
KVZAP = Arm("kvzap", 0.25)  # with --kvzap: the surrogates the worker finds in the registry


def make_doc(tokenizer: Any, length: int, index: int) -> dict[str, Any]:
    """About ``length`` tokens of prose with :data:`FACTS` facts at spread depths."""
    rng = random.Random(f"reuse-{length}-{index}")
    chosen = prose_run(tokenizer, rng, length)
    cities = rng.sample(CITIES, FACTS)
    facts = [(c, str(rng.randrange(1_000_000, 10_000_000))) for c in cities]
    for k, (city, number) in reversed(list(enumerate(facts))):
        at = round((k + 0.5) / FACTS * len(chosen))
        chosen.insert(at, f"The special magic number for {city} is {number}.")
    return {"text": "\n\n".join(chosen), "facts": facts, "order": rng.sample(range(FACTS), FACTS)}


def turns(doc: dict[str, Any]) -> list[tuple[str, int, str | None]]:
    """``(text to append, max_tokens, expected number)`` per turn."""
    out: list[tuple[str, int, str | None]] = [
        (doc["text"] + "\n\nSummary of the text above in one sentence:", 16, None)
    ]
    for k in doc["order"]:
        city, number = doc["facts"][k]
        q = f"\n\nQuestion: What is the special magic number for {city}?\nAnswer: The special magic number for {city} is"
        out.append((q, 10, number))
    return out


def converse(
    worker: Any, tokenizer: Any, doc: dict[str, Any], arm: Arm, budget: int | None
) -> dict[str, Any]:
    """One conversation on a fresh prompt cache: each turn's correctness and cached tokens."""
    # Generated ids from their text pieces (what a client sends back is the text).
    vocab = {tokenizer.decode([i]): i for i in range(len(tokenizer.vocab))}
    prompt: list[int] = []
    out: dict[str, Any] = {"correct": [], "cached": [], "kept": [], "seconds": 0.0}
    tic = time.perf_counter()
    for text, max_tokens, expected in turns(doc):
        prompt = [*prompt, *tokenizer.encode(text, add_special_tokens=False)]
        sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=True)
        request = GenerationRequest(
            kind="completion",
            prompt=tuple(prompt),
            sampling=sampling,
            cache=arm.config(budget),
            reuse=True,
        )
        pieces, final = asyncio.run(_ask(worker, request))
        ids = [vocab[piece] for piece in pieces]
        prompt = [*prompt, *ids]
        out["cached"].append(final.cached_tokens)
        out["kept"].append(final.kv_cache.get("tokens_kept"))
        if expected is not None:
            out["correct"].append(first_number_is(tokenizer.decode(ids), expected))
    out["seconds"] = round(time.perf_counter() - tic, 2)
    return out


async def _ask(worker: Any, request: GenerationRequest) -> tuple[list[str], Any]:
    pieces: list[str] = []
    async for event in clients.worker_events(worker, request):
        if isinstance(event, Delta):
            pieces.extend(lp.token for lp in event.logprobs)
    return pieces, event  # the request's Finished


def main(argv: list[str] | None = None) -> dict[str, Any]:
    study = start(
        STUDY,
        argv,
        __doc__,
        flags={
            "--kvzap": {
                "action": "store_true",
                "help": "also run KVzap, with the model's surrogates from the registry (as "
                "the server loads them)",
            }
        },
        docs=(6, 1),
        length=(1500, 200, "document tokens"),
        ratios=([2, 4, 8], [4]),
    )
    args, ratios = study.args, study.args.ratios
    tokenizer, loaded = study.tokenizer, study.loaded
    arms = dict(ARMS)
    if args.kvzap:
        model_id = model_id_for(study.identity["model_id"])
        if find_surrogate(model_id) is None:
            raise ValueError(
                f"--kvzap needs KVzap surrogates for {model_id!r} in the registry (the worker "
                "loads them from there): make them with `qfserve calibrate --kvzap`"
            )
        arms[KVZAP.name] = KVZAP

    def measure(d: int, name: str, ratio: str) -> dict[str, Any]:
        doc = make_doc(tokenizer, args.length, d)
        tokens = len(tokenizer.encode(doc["text"]))
        budget = None if ratio == "-" else round(tokens / int(ratio))
        worker = clients.start_worker(study, model=loaded.name, prompt_cache_size=4)
        try:
            return {
                "doc": d,
                "arm": name,
                "ratio": ratio,
                "budget": budget,
                "doc_tokens": tokens,
                **converse(worker, tokenizer, doc, arms[name], budget),
            }
        finally:
            worker.stop()

    todo = [
        (d, name, str(r))
        for d in range(args.docs)
        for name, arm in arms.items()
        for r in (["-"] if arm.method == "full" else ratios)
    ]
    records = study.logged(("doc", "arm", "ratio"), todo, measure, "conversations")
    correct: dict[str, dict[str, list[bool]]] = {}
    for rec in records:
        correct.setdefault(rec["arm"], {}).setdefault(rec["ratio"], []).extend(rec["correct"])
    accuracy = {a: {r: float(np.mean(v)) for r, v in by.items()} for a, by in correct.items()}
    style = lambda arm: {"color": COLORS[arm.partition("/")[0]], "label": arm_label(arm)}  # noqa: E731
    title = f"{study.identity['path']}: questions in later turns"
    return study.save(
        {
            "data": {
                "documents": args.docs,
                "document_tokens": args.length,
                "facts": FACTS,
                "scoring": "first number of the greedy answer equals the city's",
            },
            "ratios": ratios,
            "arms": list(arms),
            "budget_rule": "budget = round(document tokens / ratio), recent = budget/4",
            "every_later_turn_reused": all(all(c > 0 for c in r["cached"][1:]) for r in records),
            "accuracy": accuracy,
            "records": records,
            "plots": [accuracy_plot(accuracy, ratios, args.out, STUDY, title, style)],
        }
    )


def render(d: dict[str, Any]) -> list[str]:
    data = d["data"]
    intro = (
        f"{data['documents']} documents of about {data['document_tokens']:,} tokens "
        f"holding {data['facts']} facts, each asked in a later turn; {data['scoring']}; "
        f"{d['budget_rule']}. Every later turn reused its cache: "
        f"{d['every_later_turn_reused']}. Accuracy:"
    )
    rows = {arm_label(a): by for a, by in d["accuracy"].items()}
    accuracy = accuracy_table(d["ratios"], rows)
    return section("KVzip through the prompt cache: facts asked turns later", d, intro, accuracy)
