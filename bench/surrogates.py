"""The KVzap surrogates a study's kvzap arms score rows with: the registry's file for the model
(what a server serving it loads), or trained afresh on training-split text, as the calibrated
filters are (:func:`bench.arms.filters_for`), and cached on disk beside them."""

from __future__ import annotations

import hashlib
from typing import Any

from bench import arms
from bench.data import split_files
from qfserve.calibrations.corpus import read_documents
from qfserve.calibrations.kvzap.surrogate import Surrogate, read_surrogate, save_surrogate
from qfserve.calibrations.kvzap.train import (
    DEFAULT_EVAL_TEXTS,
    DEFAULT_TEXTS,
    DEFAULT_TOKENS,
    held_out_documents,
    train_surrogates,
)
from qfserve.calibrations.registry import find_surrogate, model_id_for

TEXT = "A"  # the calibrated filters' text: both learn from the same training-split files
# (training texts, held-out texts, tokens per text, forms): `qfserve calibrate --kvzap`'s
# defaults in full mode; with --quick, a linear surrogate from two 64-token texts (seconds).
FULL_SETTINGS = (DEFAULT_TEXTS, DEFAULT_EVAL_TEXTS, DEFAULT_TOKENS, ("linear", "mlp"))
QUICK_SETTINGS = (2, 1, 64, ("linear",))


def surrogate_for(
    model: Any,
    tokenizer: Any,
    identity: dict[str, Any],
    *,
    mode: str = "auto",
    quick: bool = False,
    seed: int = 0,
) -> tuple[Surrogate, dict[str, Any]]:
    """The model's KVzap surrogates and a JSON-able record of where they came from: the
    registry's file (``mode`` ``auto`` when one exists, or ``registry``), else trained afresh
    on calibration text :data:`TEXT` and measured on held-out prose (``quick``: tiny sizes).

    Raises:
        ValueError: an unknown ``mode``, or ``registry`` and the model has no surrogate file.
        qfserve.calibrations.kvzap.surrogate.SurrogateError: the registry's file is damaged or
            for other weights.
    """
    if mode not in ("auto", "registry", "fresh"):
        raise ValueError(f"mode must be 'auto', 'registry' or 'fresh', got {mode!r}")
    model_id = identity["model_id"]
    path = None if mode == "fresh" else find_surrogate(model_id_for(model_id))
    if path is not None:
        surrogate = read_surrogate(path, fingerprint=identity["fingerprint"])
        return surrogate, {
            "source": "registry",
            "path": str(path),
            "form": surrogate.form,
            "spearman_median": surrogate.fidelity.get("spearman_median"),
            "train_texts": surrogate.fidelity.get("train_texts"),
            "tokens": surrogate.fidelity.get("tokens"),
            "disjoint_from_eval": "unknown: `qfserve calibrate --kvzap` trains on stdlib files "
            "of both splits unless given --text",
        }
    if mode == "registry":
        raise ValueError(
            f"no KVzap surrogates for {model_id!r} (mode=registry): make them with "
            "`qfserve calibrate --kvzap`"
        )
    return _fresh(model, tokenizer, identity, quick=quick, seed=seed)


def _fresh(
    model: Any, tokenizer: Any, identity: dict[str, Any], *, quick: bool, seed: int
) -> tuple[Surrogate, dict[str, Any]]:
    texts, eval_texts, tokens, forms = QUICK_SETTINGS if quick else FULL_SETTINGS
    files = arms.text_files(TEXT, seed)
    record = {
        "source": "fresh",
        "text": f"text {TEXT}: training-split stdlib *.py files (as the calibrated filters'), "
        f"the first {texts} of {tokens} tokens or more",
        "held_out": "long descriptions of the installed Python distributions (prose)",
        "disjoint_from_eval": not (set(files) & set(split_files("eval"))),
    }
    key = f"kvzap-{identity['weights_sha1']}-{TEXT}-{texts}-{eval_texts}-{tokens}-{forms}-{seed}"
    path = arms.CACHE_DIR / f"{hashlib.sha1(key.encode()).hexdigest()[:16]}.kvzap"
    if path.is_file():
        surrogate = read_surrogate(path, fingerprint=identity["fingerprint"])
    else:
        trained = train_surrogates(
            model,
            tokenizer,
            read_documents(files),
            held_out_documents(),
            texts=texts,
            eval_texts=eval_texts,
            tokens=tokens,
            forms=forms,
            seed=seed,
        )
        # As `qfserve calibrate --kvzap`: the form that ranks held-out keys better.
        surrogate = max(trained.values(), key=lambda s: s.fidelity["spearman_median"])
        surrogate.model_id, surrogate.fingerprint = identity["model_id"], identity["fingerprint"]
        surrogate.fidelity["forms"] = {f: s.fidelity["spearman_median"] for f, s in trained.items()}
        save_surrogate(path, surrogate)
    fidelity = surrogate.fidelity
    return surrogate, {
        **record,
        "form": surrogate.form,
        "spearman_median": fidelity.get("spearman_median"),
        "forms": fidelity.get("forms"),
        "train_texts": fidelity.get("train_texts"),
        "tokens": fidelity.get("tokens"),
    }
