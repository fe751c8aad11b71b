"""KVzip against NVIDIA kvpress's ``KVzipPress`` on the same model and the same token ids.

kvpress runs in its own Python (``--kvpress-python``, ``bench/reference/kvpress_kvzip.py``);
per ratio: accuracy and the overlap of the rows each keeps per (layer, KV head). The same
comparison of KVzap (``kvzap_parity``, ``method="kvzap"``) hands our surrogates to kvpress's
``KVzapPress`` and checks that both score the same hidden states alike.
"""

from __future__ import annotations

import json
import random
import subprocess
import tempfile
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from bench.arms import Arm, feed_block
from bench.data import CITIES, first_number, first_number_is, prose_run
from bench.plots import accuracy_plot
from bench.report import accuracy_table, ratio_table, section
from bench.resume import measured, read_jsonl, resume
from bench.run import start
from bench.studies.retrieval.retrieval import prefill_block
from qfserve.calibrations.kvzap.surrogate import save_surrogate, spearman
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.models.catalog import SMOLLM2_135M, gguf_path

STUDY = "kvzip_parity"
REFERENCE = Path(__file__).resolve().parents[2] / "reference" / "kvpress_kvzip.py"
# Our allocations per method. KVzip: rows shared across layers (the default), across a layer's
# heads, per head. KVzap: per head first, as KVzapPress (a ScorerPress) keeps them, then shared
# across layers (the server's default).
MODES = {"kvzip": ("global", "adaptive", "per_head"), "kvzap": ("per_head", "global")}
PRESSES = {"kvzip": "KVzipPress", "kvzap": "KVzapPress"}
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


def ours(
    study: Any, doc: dict[str, Any], ratios: list[int], method: str = "kvzip"
) -> dict[str, dict[str, Any]]:
    """Our KVzip (or KVzap) on the context at each ratio and allocation, then the question and
    answer kept whole; the pass (or the hidden states) runs once per document (its scores do
    not depend on the budget)."""
    model, context = study.model, doc["context_ids"]
    if method == "kvzap":
        block = prefill_block(model, [*context, 0], hidden=True)
    else:
        block = prefill_block(model, [*context, 0], kvzip=study.repeat)
    out: dict[str, dict[str, Any]] = {mode: {} for mode in MODES[method]}
    for mode in MODES[method]:
        for ratio in ratios:
            caches = _caches(study, method, mode, len(context), ratio)
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


def _caches(study: Any, method: str, mode: str, n: int, ratio: int) -> list[Any]:
    """Fresh caches of ``method`` in allocation ``mode`` keeping ``1 / ratio`` of ``n`` rows."""
    if method == "kvzip":
        arm = Arm("kvzip", 0.0, adaptive=mode == "adaptive", shared=mode == "global")
        return arm.caches(study.model, round(n / ratio), study.filters)
    # As KVzapPress: int(n * (1 - compression_ratio)) rows a head, no sinks, no recent window;
    # positions kept to compare the rows.
    config = Arm("kvzap", 0.0, shared=mode == "global").config(n // ratio, n_sink=0)
    return make_caches(study.model, replace(config, positions=True), surrogate=study.surrogate)


def _kept(cache: Any) -> list[list[int]]:
    """Context positions each KV head keeps (padding rows of ragged heads left out)."""
    positions = np.array(cache.kept_positions()[0])
    return [sorted(row[row >= 0].tolist()) for row in positions]


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


def score_check(study: Any, check: Path, doc: dict[str, Any]) -> dict[str, Any]:
    """Our surrogates against kvpress's ``KVzapModel`` on one document: on the hidden states
    KVzapPress scored (the same weights give the same numbers; raises if not, as a transposed
    weight would), and end to end on our own hidden states (MLX on the GGUF's quantized weights
    against torch on their float32 de-quantization: rank agreement per layer and KV head)."""
    data = np.load(check)
    hidden, theirs = data["hidden"], data["scores"]  # (L, R, D), (L, H, N)
    if str(data["id"]) != doc["id"]:
        raise RuntimeError(f"kvpress checked document {data['id']}, not {doc['id']}")
    s, rows = study.surrogate, hidden.shape[1]
    same = np.stack([s.predict(i, h).T for i, h in enumerate(hidden)])  # (L, H, R)
    diff, scale = float(np.abs(same - theirs[..., :rows]).max()), float(np.abs(theirs).max())
    if not diff <= 1e-3 * max(1.0, scale):
        raise RuntimeError(f"our surrogates and KVzapModel differ by {diff} on the same states")
    block = prefill_block(study.model, [*doc["context_ids"], 0], hidden=True)
    ours_h = [np.array(b.hidden, dtype=np.float32)[0] for b in block]
    mine = np.stack([s.predict(i, h).T for i, h in enumerate(ours_h)])  # (L, H, N)
    pairs = zip(mine.reshape(-1, mine.shape[-1]), theirs.reshape(-1, mine.shape[-1]), strict=True)
    rho = [spearman(m, t) for m, t in pairs]
    drift = [
        float(np.abs(o[:rows] - h).max() / np.abs(h).max())
        for o, h in zip(ours_h, hidden, strict=True)
    ]
    return {
        "document": doc["id"],
        "same_hidden_states": {"rows": rows, "max_abs_diff": diff, "max_abs_score": scale},
        "own_hidden_states": {
            "rows": int(theirs.shape[-1]),
            "spearman_mean": float(np.mean(rho)),
            "spearman_min": float(np.min(rho)),
            "max_abs_diff": float(np.abs(mine - theirs).max()),
            "hidden_max_rel_diff": max(drift),
        },
    }


def main(
    argv: list[str] | None = None, method: str = "kvzip", doc: str = __doc__
) -> dict[str, Any]:
    name = f"{method}_parity"
    study = start(
        name,
        argv,
        doc,
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
        raise SystemExit(f"{name} compares on a GGUF file; {gguf} is none")
    out = args.out / name
    out.mkdir(parents=True, exist_ok=True)
    docs = chat_docs(study.tokenizer, args.docs, args.length, args.seed)
    (out / "docs.json").write_text(json.dumps(docs))
    log = out / "kvpress.jsonl"
    command = [args.kvpress_python, str(REFERENCE), "--gguf", str(gguf)]
    command += ["--docs", str(out / "docs.json"), "--out", str(log)]
    command += ["--ratios", *map(str, args.ratios)]
    check: dict[str, Any] | None = None
    with tempfile.TemporaryDirectory() as tmp:
        if method == "kvzap":  # our surrogates, handed to KVzapPress
            from bench.surrogates import surrogate_for

            study.surrogate, study.calibration["kvzap"] = surrogate_for(
                study.model,
                study.tokenizer,
                study.identity,
                mode=args.calibration,
                quick=args.quick,
                seed=args.seed,
            )
            surrogate = save_surrogate(Path(tmp) / "surrogate.kvzap", study.surrogate)
            command += ["--press", "kvzap", "--surrogate", str(surrogate)]
            command += ["--check", str(Path(tmp) / "check.npz")]
        subprocess.run(command, check=True)
        if method == "kvzap":
            check = score_check(study, Path(tmp) / "check.npz", docs[0])
    # doc id -> kvpress mode -> record (one mode: KVzipPress's default, ratios across layers;
    # KVzapPress's, the same share per head)
    theirs = {rec["id"]: {rec["mode"]: rec} for rec in read_jsonl(log)}
    by_id = {doc["id"]: doc for doc in docs}
    mine = measured(
        out / "ours.jsonl",
        resume(out / "ours.jsonl", lambda r: (r["id"],)),
        [(i,) for i in by_id],
        lambda i: {"id": i, "modes": ours(study, by_id[i], args.ratios, method)},
        "documents",
    )
    cells: dict[str, dict[str, list[Any]]] = defaultdict(lambda: defaultdict(list))
    for doc, rec in zip(docs, mine, strict=True):
        ref = theirs[doc["id"]]
        cells["full"]["-"].append(next(iter(ref.values()))["full"]["correct"])
        for r in map(str, args.ratios):
            for kind, kvpress in ref.items():
                cells[f"kvpress/{kind}"][r].append(kvpress["ratios"][r]["correct"])
            for mode in MODES[method]:
                cell = rec["modes"][mode][r]
                cells[f"ours/{mode}"][r].append(cell["correct"])
                for kind, kvpress in ref.items():
                    theirs_r = kvpress["ratios"][r]
                    same = first_number(cell["text"]) == first_number(theirs_r["text"])
                    pair = cells[f"overlap/{mode}~{kind}"][r]
                    pair.append({**overlap(cell["kept"], theirs_r["kept"]), "same_answer": same})
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
    label = {"kvzip": "KVzip", "kvzap": "KVzap"}[method]
    title = f"{study.identity['path']}: {label}, ours and kvpress's"
    kvpress = {"script": str(REFERENCE.relative_to(REFERENCE.parents[2])), "press": PRESSES[method]}
    if method == "kvzap":
        kvpress["settings"] = (
            f'KVzapPress(model_type="{study.surrogate.form}", compression_ratio=1 - 1/ratio) '
            "with our weights in its KVzapModel: every KV head keeps int(n / ratio) of the n "
            "context rows, no sinks, no recent window; ours per head the same (0 sinks, recent "
            "0); ours/global, rows shared across layers (the server's default allocation, here "
            "also without sinks), has no kvpress counterpart and is shown beside them"
        )
    return study.save(
        {
            "data": {"documents": len(docs), "context_tokens": args.length, "scoring": SCORING},
            "ratios": args.ratios,
            "accuracy": accuracy,
            "overlap": overlaps,
            "kvpress": kvpress,
            **({"score_check": check} if check is not None else {}),
            "plots": [accuracy_plot(accuracy, args.ratios, args.out, name, title)],
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
    answers = all("same_answer" in c for by in pairs.values() for c in by.values())

    def cell(by: dict[str, Any], r: int) -> str:
        c = by[str(r)]
        same = f" / {c['same_answer']:.2f}" if answers else ""
        return f"{c['recall_of_kvpress']:.2f} / {c['jaccard']:.2f}{same}"

    kept = ratio_table("pair", ratios, pairs, cell)
    rows = (
        "Rows kept per (layer, KV head): share of kvpress's kept context rows ours keeps too / "
        "Jaccard index"
        + (" / share of documents whose answers have the same first number (or none)" * answers)
        + ":"
    )
    press = d["kvpress"].get("press", "KVzipPress")
    blocks: list[str | list[str]] = [intro, accuracy, rows, kept]
    if settings := d["kvpress"].get("settings"):
        blocks.insert(0, f"Settings: {settings}.")
    if check := d.get("score_check"):
        same, own = check["same_hidden_states"], check["own_hidden_states"]
        blocks.append(
            f"Scores, document {check['document']}: on the {same['rows']} first hidden states "
            f"of every layer KVzapPress scored, ours and its KVzapModel's differ by at most "
            f"{same['max_abs_diff']:.1e} (scores up to {same['max_abs_score']:.1f}); from each "
            f"side's own hidden states (MLX on the quantized GGUF, torch on its float32 "
            f"de-quantization; they differ by up to {own['hidden_max_rel_diff']:.1e} of a "
            f"layer's largest), Spearman's rho per (layer, KV head) over its {own['rows']} "
            f"rows: mean {own['spearman_mean']:.4f}, least {own['spearman_min']:.4f}; the "
            f"scores differ by at most {own['max_abs_diff']:.1e}."
        )
    return section(f"{press[:-5]} against kvpress's {press}", d, *blocks)
