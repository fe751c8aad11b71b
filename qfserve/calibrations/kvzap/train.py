"""Training KVzap's surrogates on text every machine has, and measuring them on other text.

Training text is the Python standard library's sources (:func:`qfserve.calibrations.corpus.
stdlib_files`): code, comments and docstrings. Held-out text is from another source: the
long descriptions of the installed Python distributions (their ``METADATA``: READMEs in prose
and markdown), so fidelity is measured on text the surrogates never saw, of another kind.
Each text gives the first ``tokens`` of a document whose head is that long (kvpress keeps
texts of 750-1,250 tokens); the ridge sums take every context token, the MLP a sample of
``positions`` per text (the same positions at every layer).

Fidelity, per layer: Spearman's correlation between predicted and exact log KVzip+ scores
over the held-out tokens and KV heads; reported per layer and as the median over layers.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from qfserve.calibrations.kvzap.surrogate import (
    FORMS,
    RidgeSums,
    Surrogate,
    spearman,
    train_mlp,
)
from qfserve.calibrations.kvzap.targets import TextTargets, text_targets
from qfserve.calibrations.repeat import RepeatPrompt

DEFAULT_TEXTS = 48
DEFAULT_EVAL_TEXTS = 8
DEFAULT_TOKENS = 1024
DEFAULT_POSITIONS = 192
# The MLP is ~100x the linear map's bytes (22.6 MiB against 0.2 on Gemma 3 270M) and a larger
# product per row written: it is kept only where it ranks held-out keys clearly better.
MLP_MARGIN = 0.02


def choose(trained: dict[str, Surrogate]) -> Surrogate:
    """The surrogate to write of each form ``trained``: the linear one unless the MLP's
    held-out Spearman median beats it by more than :data:`MLP_MARGIN`."""
    linear, mlp = trained.get("linear"), trained.get("mlp")
    if linear is None or mlp is None:
        return max(trained.values(), key=lambda s: s.fidelity["spearman_median"])
    gain = mlp.fidelity["spearman_median"] - linear.fidelity["spearman_median"]
    return mlp if gain > MLP_MARGIN else linear


def held_out_documents() -> list[str]:
    """Long descriptions of the installed distributions, sorted by name (prose, not code)."""
    docs = {}
    for dist in importlib.metadata.distributions():
        meta: Any = dist.metadata  # an email.message.Message
        name = (meta.get("Name") or "").lower()
        body = meta.get_payload() if hasattr(meta, "get_payload") else None
        text = body or meta.get("Description") or ""
        if name and isinstance(text, str) and len(text) > 6000:
            docs[name] = text
    return [docs[k] for k in sorted(docs)]


def texts_of(tokenizer: Any, documents: Iterable[str], n: int, tokens: int) -> list[list[int]]:
    """The first ``tokens`` tokens of up to ``n`` documents at least that long."""
    out = []
    for doc in documents:
        ids = tokenizer.encode(doc[: tokens * 16], add_special_tokens=False)
        if len(ids) >= tokens:
            out.append(list(ids[:tokens]))
        if len(out) == n:
            break
    return out


def fidelity(surrogate: Surrogate, held_out: Sequence[TextTargets]) -> dict[str, Any]:
    """Per layer and median Spearman correlation of predicted and exact targets."""
    per_layer: list[float | None] = []
    for i, on in enumerate(surrogate.layers):
        if not on:
            per_layer.append(None)
            continue
        pred, true = [], []
        for t in held_out:
            x, y = t.hidden[i], t.targets[i]
            assert x is not None and y is not None
            pred.append(surrogate.predict(i, x).ravel())
            true.append(y.ravel())
        per_layer.append(spearman(np.concatenate(pred), np.concatenate(true)))
    values = [v for v in per_layer if v is not None]
    return {
        "spearman_median": float(np.median(values)),
        "spearman_per_layer": [None if v is None else round(v, 4) for v in per_layer],
    }


def train_surrogates(
    model: Any,
    tokenizer: Any,
    train_docs: Iterable[str],
    eval_docs: Iterable[str],
    *,
    texts: int = DEFAULT_TEXTS,
    eval_texts: int = DEFAULT_EVAL_TEXTS,
    tokens: int = DEFAULT_TOKENS,
    positions: int = DEFAULT_POSITIONS,
    forms: Sequence[str] = FORMS,
    seed: int = 0,
    progress: Callable[[int], None] | None = None,
) -> dict[str, Surrogate]:
    """Each form's surrogates, trained and measured (``fidelity`` set on each).

    Raises:
        ValueError: the text gave no training or no held-out text of ``tokens`` tokens.
    """
    repeat = RepeatPrompt.for_tokenizer(tokenizer)
    train = texts_of(tokenizer, train_docs, texts, tokens)
    held = texts_of(tokenizer, eval_docs, eval_texts, tokens)
    if not train or not held:
        raise ValueError(
            f"need texts of {tokens} tokens: got {len(train)} to train on, {len(held)} held out"
        )
    rng = np.random.default_rng(seed)
    sums: list[RidgeSums | None] = []
    rows_x: list[np.ndarray] = []
    rows_y: list[np.ndarray] = []
    layers: list[bool] = []
    for ids in train:
        t = text_targets(model, ids, repeat)
        if not layers:
            layers = [y is not None for y in t.targets]
            sums = [
                None if y is None else RidgeSums(x.shape[1], y.shape[1])  # type: ignore[union-attr]
                for x, y in zip(t.hidden, t.targets, strict=True)
            ]
        pick = rng.choice(len(ids), size=min(positions, len(ids)), replace=False)
        xs, ys = [], []
        for i, s in enumerate(sums):
            x, y = t.hidden[i], t.targets[i]
            if s is None or x is None or y is None:
                continue
            s.add(x, y)
            xs.append(x[pick])
            ys.append(y[pick])
        rows_x.append(np.stack(xs, axis=1).astype(np.float16))
        rows_y.append(np.stack(ys, axis=1))
        if progress is not None:
            progress(1)
    held_targets = [text_targets(model, ids, repeat) for ids in held]
    on = [i for i, flag in enumerate(layers) if flag]
    L = len(layers)
    out: dict[str, Surrogate] = {}
    if "linear" in forms:
        solved = [s.solve() for s in sums if s is not None]
        D, H = solved[0][0].shape
        w = np.zeros((L, D, H), np.float32)
        b = np.zeros((L, H), np.float32)
        for i, (wi, bi) in zip(on, solved, strict=True):
            w[i], b[i] = wi, bi
        out["linear"] = Surrogate("linear", {"w": w, "b": b}, layers)
    if "mlp" in forms:
        trained = train_mlp(np.concatenate(rows_x), np.concatenate(rows_y), seed=seed)
        full = {}
        for name, value in trained.items():
            stacked = np.zeros((L, *value.shape[1:]), np.float32)
            stacked[on] = value
            full[name] = stacked
        out["mlp"] = Surrogate("mlp", full, layers)
    for surrogate in out.values():
        surrogate.fidelity = {
            **fidelity(surrogate, held_targets),
            "train_texts": len(train),
            "held_out_texts": len(held),
            "tokens": tokens,
        }
    return out
