"""KVzip against NVIDIA kvpress's ``KVzipPress`` on the same model and the same token ids.

Needle-in-prose chats split as kvpress splits them: the context compressed, then the question
appended whole and the answer decoded greedily. kvpress runs in its own Python
(``--kvpress-python``, ``bench/reference/kvpress_kvzip.py``); reported per ratio: accuracy and
the overlap of the rows each keeps per (layer, KV head).
"""

from __future__ import annotations

import json
import random
import re
import subprocess
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from bench.arms import Arm, feed_block
from bench.data import stdlib_prose
from bench.harness import (
    append_jsonl,
    open_run,
    parse,
    parser,
    progress,
    read_jsonl,
    save_plot,
    subplots,
)
from bench.report import fmt, plots, quality_header, table
from bench.studies.niah import CITIES
from bench.studies.retrieval import prefill_block

STUDY = "kvzip_parity"
REFERENCE = Path(__file__).resolve().parents[1] / "reference" / "kvpress_kvzip.py"
MODES = {
    "global": "ours, rows shared across layers (the default)",
    "adaptive": "ours, across a layer's heads",
    "per_head": "ours, per head",
}


def chat_docs(tokenizer: Any, n: int, length: int, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` chat documents of about ``length`` context tokens (see the module doc)."""
    paragraphs = stdlib_prose()
    docs = []
    for i in range(n):
        rng = random.Random(f"parity-{seed}-{length}-{i}")
        city, number = rng.choice(CITIES), str(rng.randrange(1_000_000, 10_000_000))
        needle = f"The special magic number for {city} is {number}."
        chosen, start = [], rng.randrange(len(paragraphs))
        while len(tokenizer.encode("\n\n".join(chosen))) < length:
            chosen.append(paragraphs[(start + len(chosen)) % len(paragraphs)])
        chosen.insert(rng.randrange(len(chosen) + 1), needle)
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
    kept whole. The pass runs once per document (its scores do not depend on the budget)."""
    model, context = study.model, doc["context_ids"]
    block = prefill_block(model, [*context, 0], kvzip=study.repeat)
    out: dict[str, dict[str, Any]] = {}
    for mode in MODES:
        for ratio in ratios:
            budget = round(len(context) / ratio)
            arm = Arm("kvzip", 0.0, adaptive=mode == "adaptive", shared=mode == "global")
            caches = arm.caches(model, budget, study.filters)
            feed_block(caches, block)
            kept = [_kept(c) for c in caches]
            for c in caches:  # as kvpress: what follows the context is not compressed
                c.budget += len(doc["question_ids"]) + doc["max_new_tokens"] + 1
            y, tokens = mx.array(doc["question_ids"])[None], []
            for _ in range(doc["max_new_tokens"]):
                y = mx.argmax(model(y, cache=caches)[:, -1], axis=-1)[None]
                tokens.append(int(y.item()))
            text = study.tokenizer.decode(tokens)
            out.setdefault(mode, {})[str(ratio)] = {
                "text": text,
                "correct": _correct(text, doc["answer"]),
                "kept": kept,
            }
    return out


def _kept(cache: Any) -> list[list[int]]:
    """Context positions each KV head keeps (padding rows of ragged heads left out)."""
    positions = np.array(cache.positions[0])
    valid = np.ones(positions.shape, bool) if cache.valid is None else np.array(cache.valid[0])
    return [sorted(positions[h][valid[h]].tolist()) for h in range(positions.shape[0])]


def _correct(text: str, answer: str) -> bool:
    found = re.search(r"\d+", text)
    return bool(found and found.group() == answer)


def overlap(a: list[list[list[int]]], b: list[list[list[int]]]) -> dict[str, float]:
    """Mean over (layer, head) of |a & b| / |b| (recall of ``b``'s rows) and the Jaccard."""
    recall, jaccard = [], []
    for la, lb in zip(a, b, strict=True):
        for ha, hb in zip(la, lb, strict=True):
            sa, sb = set(ha), set(hb)
            recall.append(len(sa & sb) / max(len(sb), 1))
            jaccard.append(len(sa & sb) / max(len(sa | sb), 1))
    return {"recall_of_kvpress": float(np.mean(recall)), "jaccard": float(np.mean(jaccard))}


def run_kvpress(
    python: str, gguf: Path, docs: Path, out: Path, ratios: list[int], layerwise: bool
) -> None:
    cmd = [python, str(REFERENCE), "--gguf", str(gguf), "--docs", str(docs), "--out", str(out),
           "--ratios", *map(str, ratios)]  # fmt: skip
    if layerwise:
        cmd.append("--layerwise")
    subprocess.run(cmd, check=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, calibration=True, docs=(20, 2), ratios=[2, 4, 8],
               length=(1200, 1200, "context tokens per document"))  # fmt: skip
    p.add_argument("--kvpress-python", required=True, help="a Python with torch and kvpress")
    p.add_argument("--layerwise", action="store_true", help="also run kvpress with layerwise=True")
    p.add_argument("--gguf", type=Path, default=None,
                   help="the GGUF kvpress loads (default: --model's, or the catalog model's)")  # fmt: skip
    args = parse(p, argv)
    study = open_run(STUDY, args, argv, calibrate=True)
    gguf = args.gguf or (Path(args.model) if str(args.model).endswith(".gguf") else None)
    if gguf is None:
        from qfserve.engine.models.catalog import SMOLLM2_135M, gguf_path

        gguf = gguf_path(SMOLLM2_135M)
    if not gguf.is_file():
        raise SystemExit(f"{STUDY} compares on a GGUF file; {gguf} is none")
    out = args.out / STUDY
    out.mkdir(parents=True, exist_ok=True)
    docs = chat_docs(study.tokenizer, args.docs, args.length, args.seed)
    (out / "docs.json").write_text(json.dumps(docs))
    theirs: dict[str, dict[str, Any]] = {}
    for layerwise in (False, True) if args.layerwise else (False,):
        log = out / f"kvpress{'_layerwise' if layerwise else ''}.jsonl"
        run_kvpress(args.kvpress_python, gguf, out / "docs.json", log, args.ratios, layerwise)
        mode = "layerwise" if layerwise else "global"
        for rec in read_jsonl(log):
            theirs.setdefault(rec["id"], {})[mode] = rec
    mine_log = out / "ours.jsonl"
    mine = {rec["id"]: rec["modes"] for rec in read_jsonl(mine_log)}
    cells: dict[str, dict[str, list[Any]]] = {}
    with progress(total=len(docs), desc="documents") as bar:
        for doc in docs:
            if doc["id"] not in mine:
                mine[doc["id"]] = ours(study, doc, args.ratios)
                append_jsonl(mine_log, {"id": doc["id"], "modes": mine[doc["id"]]})
            ref = theirs[doc["id"]]
            cells.setdefault("full", {}).setdefault("-", []).append(
                ref["global"]["full"]["correct"]
            )
            for ratio in args.ratios:
                r = str(ratio)
                for mode_name, rec in ref.items():
                    cell = rec["ratios"][r]
                    cells.setdefault(f"kvpress/{mode_name}", {}).setdefault(r, []).append(
                        cell["correct"]
                    )
                for mode in MODES:
                    cell = mine[doc["id"]][mode][r]
                    cells.setdefault(f"ours/{mode}", {}).setdefault(r, []).append(cell["correct"])
                    for mode_name, rec in ref.items():
                        key = f"overlap/{mode}~{mode_name}"
                        cells.setdefault(key, {}).setdefault(r, []).append(
                            overlap(cell["kept"], rec["ratios"][r]["kept"])
                        )
            bar.update(1)
    accuracy = {arm: {r: float(np.mean(v)) for r, v in by.items()}
                for arm, by in cells.items() if not arm.startswith("overlap")}  # fmt: skip
    overlaps = {
        arm: {r: {k: float(np.mean([o[k] for o in v])) for k in v[0]} for r, v in by.items()}
        for arm, by in cells.items()
        if arm.startswith("overlap")
    }
    fig, ax = subplots(1, 1)
    for arm, by in accuracy.items():
        if arm == "full":
            ax[0, 0].axhline(by["-"], color="black", ls="--", label="full cache")
            continue
        ax[0, 0].plot(args.ratios, [by[str(r)] for r in args.ratios], marker="o", label=arm)
    ax[0, 0].set(xscale="log", xlabel="compression", ylabel="accuracy", ylim=(-0.05, 1.05))
    ax[0, 0].legend(fontsize=7)
    save_plot(fig, args.out, STUDY, f"{study.identity['path']}: KVzip, ours and kvpress's")
    return study.save(
        {
            "data": {
                "documents": len(docs),
                "context_tokens": args.length,
                "scoring": "first number of the greedy answer equals the needle's",
            },  # fmt: skip
            "ratios": args.ratios,
            "accuracy": accuracy,
            "overlap": overlaps,
            "kvpress": {"script": str(REFERENCE.relative_to(REFERENCE.parents[2]))},
            "plots": [f"{STUDY}.png"],
        }
    )


def render(d: dict[str, Any]) -> list[str]:
    """This study's section of ``bench/RESULTS.md``."""
    ratios, data = d["ratios"], d["data"]
    lines = quality_header("KVzip against kvpress's KVzipPress", d)
    lines += ["", f"{data['documents']} needle-in-chat documents of about "
              f"{data['context_tokens']:,} context tokens, compressed, then the question kept "
              f"whole; {data['scoring']}. Accuracy:", ""]  # fmt: skip
    cell = lambda by, r: fmt(by.get(str(r), by.get("-")), 2)  # noqa: E731
    lines += table(["arm", *[f"{r}×" for r in ratios]],
                   [[arm, *(cell(by, r) for r in ratios)] for arm, by in d["accuracy"].items()])  # fmt: skip
    lines += ["", "Rows kept per (layer, KV head): share of kvpress's kept context rows ours keeps "
              "too / Jaccard index:", ""]  # fmt: skip
    lines += table(["pair", *[f"{r}×" for r in ratios]], [
        [pair.removeprefix("overlap/"), *(f"{by[str(r)]['recall_of_kvpress']:.2f} / "
                                          f"{by[str(r)]['jaccard']:.2f}" for r in ratios)]
        for pair, by in d["overlap"].items()])  # fmt: skip
    return lines + plots(d)
