"""KVzip against NVIDIA kvpress's ``KVzipPress`` on the same model and the same token ids.

kvpress runs in its own Python (``--kvpress-python``, ``bench/reference/kvpress_kvzip.py``);
per ratio: accuracy and the overlap of the rows each keeps per (layer, KV head).
"""

from __future__ import annotations

import json
import random
import subprocess
from collections import defaultdict
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from bench.arms import Arm, feed_block
from bench.data import CITIES, first_number_is, prose_run
from bench.plots import accuracy_plot
from bench.report import accuracy_table, ratio_table, section
from bench.resume import measured, read_jsonl, resume
from bench.run import start
from bench.studies.retrieval.retrieval import prefill_block
from qfserve.engine.models.catalog import SMOLLM2_135M, gguf_path

STUDY = "kvzip_parity"
REFERENCE = Path(__file__).resolve().parents[1] / "reference" / "kvpress_kvzip.py"
# Our allocations: rows shared across layers (the default), across a layer's heads, per head.
MODES = ("global", "adaptive", "per_head")
SCORING = "first number of the greedy answer equals the needle's"


def chat_docs(tokenizer: Any, n: int, length: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` chat documents of about ``length`` context tokens (see the module doc)."""
    docs = []
    for i in range(n):
        rng = random.Random(f"parity-{seed}-{length}-{i}")
        city, number = rng.choice(CITIES), str(rng.randrange(1_000_000, 10_000_000))
        chosen = prose_run(tokenizer, rng, length)
        chosen.insert(
            rng.randrange(len(chosen) + 1), f"The special magic number for {city} is {number}."
        )
        question = f"\n\nWhat is the special magic number for {city}?"
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "\n\n".join(chosen) + question}],
            add_generation_prompt=True,
            tokenize=False,
        )
        cut = text.rindex(question)
        primer = f"The special magic number for {city} is"
        docs.append(
            {
                "id": f"{length}-{i}",
                "context_ids": tokenizer.encode(text[:cut], add_special_tokens=False),
                "question_ids": tokenizer.encode(text[cut:] + primer, add_special_tokens=False),
                "answer": number,
                "max_new_tokens": len(tokenizer.encode(" " + number)) + 3,
            }
        )
    return docs


def ours(study: Any, doc: dict[str, Any], ratios: list[int]) -> dict[str, dict[str, Any]]:
    """Our KVzip on the context at each ratio and allocation, then the question and answer
    kept whole; the pass runs once per document (its scores do not depend on the budget)."""
    model, context = study.model, doc["context_ids"]
    block = prefill_block(model, [*context, 0], kvzip=study.repeat)
    out: dict[str, dict[str, Any]] = {mode: {} for mode in MODES}
    for mode in MODES:
        arm = Arm("kvzip", 0.0, adaptive=mode == "adaptive", shared=mode == "global")
        for ratio in ratios:
            caches = arm.caches(model, round(len(context) / ratio), study.filters)
            feed_block(caches, block)
            kept = [_kept(c) for c in caches]
            for c in caches:  # as kvpress: what follows the context is not compressed
                c.budget += len(doc["question_ids"]) + doc["max_new_tokens"] + 1
            y, tokens = mx.array(doc["question_ids"])[None], []
            for _ in range(doc["max_new_tokens"]):
                y = mx.argmax(model(y, cache=caches)[:, -1], axis=-1)[None]
                tokens.append(int(y.item()))
            text = study.tokenizer.decode(tokens)
            out[mode][str(ratio)] = {
                "text": text,
                "correct": first_number_is(text, doc["answer"]),
                "kept": kept,
            }
    return out


def _kept(cache: Any) -> list[list[int]]:
    """Context positions each KV head keeps (padding rows of ragged heads left out)."""
    positions = np.array(cache.positions[0])
    valid = np.ones(positions.shape, bool) if cache.valid is None else np.array(cache.valid[0])
    return [sorted(positions[h][valid[h]].tolist()) for h in range(positions.shape[0])]


def overlap(a: list[list[list[int]]], b: list[list[list[int]]]) -> dict[str, float]:
    """Mean over (layer, head) of |a & b| / |b| (recall of ``b``'s rows) and the Jaccard."""
    pairs = [
        (set(ha), set(hb))
        for la, lb in zip(a, b, strict=True)
        for ha, hb in zip(la, lb, strict=True)
    ]
    return {
        "recall_of_kvpress": float(np.mean([len(a & b) / max(len(b), 1) for a, b in pairs])),
        "jaccard": float(np.mean([len(a & b) / max(len(a | b), 1) for a, b in pairs])),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    study = start(
        STUDY,
        argv,
        __doc__,
        calibration=True,
        docs=(20, 2),
        ratios=[2, 4, 8],
        length=(1200, 1200, "context tokens per document"),
        flags={"--kvpress-python": {"required": True, "help": "a Python with kvpress"}},
    )
    args = study.args
    # kvpress loads the GGUF file: --model's, or the catalog model's.
    gguf = Path(args.model) if str(args.model).endswith(".gguf") else gguf_path(SMOLLM2_135M)
    if not gguf.is_file():
        raise SystemExit(f"{STUDY} compares on a GGUF file; {gguf} is none")
    out = args.out / STUDY
    out.mkdir(parents=True, exist_ok=True)
    docs = chat_docs(study.tokenizer, args.docs, args.length, args.seed)
    (out / "docs.json").write_text(json.dumps(docs))
    log = out / "kvpress.jsonl"
    subprocess.run(
        [
            args.kvpress_python,
            str(REFERENCE),
            "--gguf",
            str(gguf),
            "--docs",
            str(out / "docs.json"),
            "--out",
            str(log),
            "--ratios",
            *map(str, args.ratios),
        ],
        check=True,
    )
    # doc id -> kvpress mode -> record (one mode, kvpress's default: ratios across layers)
    theirs = {rec["id"]: {"global": rec} for rec in read_jsonl(log)}
    by_id = {doc["id"]: doc for doc in docs}
    mine = measured(
        out / "ours.jsonl",
        resume(out / "ours.jsonl", lambda r: (r["id"],)),
        [(i,) for i in by_id],
        lambda i: {"id": i, "modes": ours(study, by_id[i], args.ratios)},
        "documents",
    )
    cells: dict[str, dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))
    for doc, rec in zip(docs, mine, strict=True):
        ref = theirs[doc["id"]]
        cells["full"]["-"].append(ref["global"]["full"]["correct"])
        for r in map(str, args.ratios):
            for name, kvpress in ref.items():
                cells[f"kvpress/{name}"][r].append(kvpress["ratios"][r]["correct"])
            for mode in MODES:
                cell = rec["modes"][mode][r]
                cells[f"ours/{mode}"][r].append(cell["correct"])
                for name, kvpress in ref.items():
                    pair = cells[f"overlap/{mode}~{name}"][r]
                    pair.append(overlap(cell["kept"], kvpress["ratios"][r]["kept"]))
    accuracy = {
        arm: {r: float(np.mean(v)) for r, v in by.items()}
        for arm, by in cells.items()
        if not arm.startswith("overlap")
    }
    overlaps = {
        arm: {r: {k: float(np.mean([o[k] for o in v])) for k in v[0]} for r, v in by.items()}
        for arm, by in cells.items()
        if arm.startswith("overlap")
    }
    title = f"{study.identity['path']}: KVzip, ours and kvpress's"
    return study.save(
        {
            "data": {"documents": len(docs), "context_tokens": args.length, "scoring": SCORING},
            "ratios": args.ratios,
            "accuracy": accuracy,
            "overlap": overlaps,
            "kvpress": {"script": str(REFERENCE.relative_to(REFERENCE.parents[2]))},
            "plots": [accuracy_plot(accuracy, args.ratios, args.out, STUDY, title)],
        }
    )


def render(d: dict[str, Any]) -> list[str]:
    ratios, data = d["ratios"], d["data"]
    intro = (
        f"{data['documents']} needle-in-chat documents of about {data['context_tokens']:,} "
        f"context tokens, compressed, then the question kept whole; {data['scoring']}. "
        "Accuracy:"
    )
    pairs = {k.removeprefix("overlap/"): by for k, by in d["overlap"].items()}
    accuracy = accuracy_table(ratios, d["accuracy"])
    kept = ratio_table(
        "pair",
        ratios,
        pairs,
        lambda by, r: f"{by[str(r)]['recall_of_kvpress']:.2f} / {by[str(r)]['jaccard']:.2f}",
    )
    rows = (
        "Rows kept per (layer, KV head): share of kvpress's kept context rows ours keeps too / "
        "Jaccard index:"
    )
    return section("KVzip against kvpress's KVzipPress", d, intro, accuracy, rows, kept)
