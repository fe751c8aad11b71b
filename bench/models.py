"""The model a study measures: loaded the way the server loads it, and named exactly.

Every study (quality and speed) takes ``--model`` as the server does: a catalog name (the
default, ``smollm2-135m-instruct``), ``qfserve-tiny`` (the bundled model, for smoke runs), a
GGUF file (converted once into the cache), an mlx-lm folder or a hub id. :func:`load` goes
through :func:`qfserve.engine.models.loading.load_model`, so a study measures what ``qfserve`` would serve,
and returns an identity (folder, model id, weight hashes, shape) that every results file
records.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import RESULTS_DIR

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = "smollm2-135m-instruct"  # what `qfserve` serves with no --model
BUNDLED = "qfserve-tiny"
# Where each model's results live by default: bench/results/<folder>/.
RESULTS_FOLDERS = {DEFAULT_MODEL: "smollm2", BUNDLED: BUNDLED}


@dataclass(frozen=True)
class BenchModel:
    """A loaded model (:class:`qfserve.engine.models.loading.LoadedModel`), its folder and its identity."""

    loaded: Any
    folder: Path
    identity: dict[str, Any]

    @property
    def model(self) -> Any:
        return self.loaded.model

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def context_length(self) -> int:
        return int(self.loaded.context_length)


def results_dir(ref: str) -> Path:
    """Default results folder for ``--model ref``: ``bench/results/<short name>``."""
    name = RESULTS_FOLDERS.get(ref)
    if name is None:
        path = Path(ref)
        name = (path.stem if path.suffix.lower() == ".gguf" else path.name) or "model"
    return RESULTS_DIR / name


def load(ref: str) -> BenchModel:
    """Load ``ref`` with the server's loader; a GGUF file or catalog name becomes its
    converted folder first (so servers a study starts load the very same folder)."""
    from qfserve.engine.models.loading import load_model, resolve_model_ref

    folder = Path(resolve_model_ref(ref))
    loaded = load_model(str(folder))
    return BenchModel(loaded, folder, identity(loaded, folder))


def identity(loaded: Any, folder: Path) -> dict[str, Any]:
    """What exactly was measured: folder, served name, model id, weight hashes and shape."""
    from mlx.utils import tree_flatten

    from qfserve.calibrations.model_info import (
        attention_modules,
        head_counts,
        max_context,
        model_fingerprint,
    )

    model = loaded.model
    digest = hashlib.sha1()
    for w in sorted(folder.glob("*.safetensors")):
        digest.update(w.read_bytes())
    state_file = folder / "training_state.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else None
    n_heads, n_kv_heads, head_dim = head_counts(attention_modules(model)[0], model)
    resolved = folder.resolve()
    return {
        "name": loaded.name,
        "path": str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(folder),
        "model_id": loaded.model_id,
        "weights_sha1": digest.hexdigest()[:12],
        "fingerprint": model_fingerprint(model, loaded.config),
        "training_state": state,
        "checkpoint": checkpoint_label(state, loaded.name),
        "n_layers": len(attention_modules(model)),
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "head_dim": head_dim,
        "hidden_size": int(loaded.config.get("hidden_size", 0)),
        "max_context": max_context(model) or loaded.context_length,
        "weight_bytes": sum(v.nbytes for _, v in tree_flatten(model.parameters())),
    }


def checkpoint_label(state: dict[str, Any] | None, name: str = "") -> str:
    """``"qfserve-tiny-recall step 1952 (18,711,040 training tokens)"`` from
    ``training_state.json``; a pretrained model without one is labelled by its name."""
    if not state:
        return f"{name} (pretrained)" if name else "unknown (no training_state.json)"
    run = f"{state['run']} " if state.get("run") else ""
    return f"{run}step {state.get('step')} ({state.get('tokens_seen', 0):,} training tokens)"
