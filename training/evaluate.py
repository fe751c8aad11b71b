"""Evaluate an exported qfserve-tiny folder through mlx-lm and write the figures as JSON.

``python -m training.evaluate --model models/qfserve-tiny`` measures, with a full KV cache:
held-out perplexity on standard-library files never trained on and on generated documents
from evaluation seeds, and pass-key retrieval accuracy by context length (greedy decoding
with ``mlx_lm.generate``). Results go to ``<model>/eval_results.json`` unless ``--out`` says.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm import generate, load

from training.data import passkey_eval_set, prepare_corpus, recall_eval_set

DEFAULT_LENGTHS = (256, 512, 1024, 2048)


def token_nll(model, rows: list[list[int]]) -> tuple[float, int]:
    """Summed next-token negative log-likelihood and token count over ``rows`` (one at a time)."""
    total, count = 0.0, 0
    for ids in rows:
        tokens = mx.array(np.array(ids, dtype=np.int32))[None]  # (1, L)
        logits = model(tokens[:, :-1]).astype(mx.float32)  # (1, L - 1, V)
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        picked = mx.take_along_axis(logprobs, tokens[:, 1:, None], axis=-1)
        total -= picked.sum().item()
        count += len(ids) - 1
    return total, count


def answer_accuracy(model, docs: list[tuple[list[int], list[int]]]) -> float:
    """Fraction of answers (runs of target tokens) predicted exactly by argmax (greedy)."""
    hits = total = 0
    for ids, targets in docs:
        preds = np.array(model(mx.array(np.array(ids, dtype=np.int32))[None]).argmax(-1))[0]
        runs: list[list[int]] = []
        for t in targets:
            (runs[-1].append(t) if runs and runs[-1][-1] == t - 1 else runs.append([t]))
        for run in runs:
            total += 1
            hits += all(preds[t - 1] == ids[t] for t in run)
    return hits / max(1, total)


def passkey_accuracy(model, tokenizer, corpus, length: int, n: int) -> dict:
    """Greedy pass-key retrieval on ``n`` held-out documents of about ``length`` tokens."""
    correct, lengths = 0, []
    for ids, targets in passkey_eval_set(corpus, length, n):
        key = corpus.tokenizer.decode([ids[t] for t in targets])
        prompt = ids[: targets[0] - 1]  # ends at "...The pass key is"; the model writes " 12345"
        lengths.append(len(prompt))
        text = generate(model, tokenizer, prompt=prompt, max_tokens=2 + len(targets), verbose=False)
        found = re.search(r"\d+", text)
        correct += bool(found and found.group() == key)
    return {"accuracy": correct / n, "n": n, "mean_prompt_tokens": float(np.mean(lengths))}


def evaluate(
    model_dir: str | Path,
    *,
    lengths: tuple[int, ...] = DEFAULT_LENGTHS,
    n_passkey: int = 50,
    n_windows: int = 64,
    window: int = 1024,
    n_docs: int = 32,
) -> dict:
    """All figures for the model card; see the module docstring."""
    model, tokenizer = load(str(model_dir))
    corpus = prepare_corpus(Path(model_dir) / "tokenizer.json")
    stream = corpus.streams["eval"]
    starts = np.linspace(0, len(stream) - window - 1, n_windows).astype(int)
    nll, count = token_nll(model, [stream[s : s + window].tolist() for s in starts])
    results: dict = {
        "model": str(model_dir),
        "heldout_stdlib": {
            "windows": n_windows,
            "window_tokens": window,
            "tokens": count,
            "loss": nll / count,
            "perplexity": math.exp(nll / count),
        },
        "heldout_generated": {},
        "passkey_full_cache": {},
    }
    for kind in ("passkey", "kv", "fact"):
        docs = recall_eval_set(corpus, kind, window, n_docs)
        nll, count = token_nll(model, [ids for ids, _ in docs])
        results["heldout_generated"][kind] = {
            "docs": len(docs),
            "doc_tokens": window,
            "tokens": count,
            "loss": nll / count,
            "perplexity": math.exp(nll / count),
            "answer_accuracy": answer_accuracy(model, docs),
        }
    for length in lengths:
        results["passkey_full_cache"][str(length)] = passkey_accuracy(
            model, tokenizer, corpus, length, n_passkey
        )
    return results


def main() -> None:
    try:  # OpenBLAS makes MLX's Linux CPU matmul much faster; this re-executes the process once.
        from qfserve.engine.models.blas import reexec_with_openblas

        reexec_with_openblas()
    except ImportError:
        pass
    parser = argparse.ArgumentParser(description="Evaluate an exported model folder with mlx-lm")
    parser.add_argument("--model", default="models/qfserve-tiny")
    parser.add_argument("--out", default=None, help="JSON path (default <model>/eval_results.json)")
    parser.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS))
    parser.add_argument("--passkey-docs", type=int, default=50)
    parser.add_argument("--windows", type=int, default=64, help="held-out stdlib windows")
    parser.add_argument("--docs", type=int, default=32, help="held-out generated docs per kind")
    args = parser.parse_args()
    t0 = time.time()
    results = evaluate(
        args.model,
        lengths=tuple(args.lengths),
        n_passkey=args.passkey_docs,
        n_windows=args.windows,
        n_docs=args.docs,
    )
    results["command"] = (
        "python -m training.evaluate --model {} --lengths {} --passkey-docs {} "
        "--windows {} --docs {}"
    ).format(
        args.model, " ".join(map(str, args.lengths)), args.passkey_docs, args.windows, args.docs
    )
    results["seconds"] = round(time.time() - t0, 1)
    out = Path(args.out) if args.out else Path(args.model) / "eval_results.json"
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
