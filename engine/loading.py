"""Find and load the model a server runs: a local folder, a Hugging Face id or the bundled model.

Loading goes through ``mlx_lm.load``; this module only decides *what* to load, which id the
calibrated Q-Filters are looked up under, and how long a context the model accepts.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import engine

if TYPE_CHECKING:
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper

logger = logging.getLogger(__name__)

DEFAULT_MODEL_DIR = Path(engine.__file__).resolve().parent.parent / "models" / "qfserve-tiny"
DEFAULT_CONTEXT_LENGTH = 4096
# Config keys that hold the trained context length, most specific first.
_CONTEXT_KEYS = (
    "max_position_embeddings",
    "max_sequence_length",
    "max_seq_len",
    "n_positions",
    "seq_length",
    "n_ctx",
)


class ModelNotFoundError(FileNotFoundError):
    """No model was named and the bundled one is missing, or a named folder is not a model."""


@dataclass(frozen=True)
class LoadedModel:
    """A model ready to generate, plus what the server reports about it.

    Attributes:
        model: The mlx-lm model.
        tokenizer: mlx-lm's ``TokenizerWrapper`` (chat template, streaming detokenizer).
        name: The id ``/v1/models`` lists: a local folder's name, or the hub id.
        model_id: The id calibrated Q-Filters are registered under.
        source: What was loaded: the local folder or the hub id.
        context_length: Most prompt + completion tokens one request may use.
    """

    model: Any
    tokenizer: Any
    name: str
    model_id: str
    source: str
    context_length: int


def default_model_path() -> Path:
    """The bundled model folder (``models/qfserve-tiny`` at the repository root)."""
    return DEFAULT_MODEL_DIR


def resolve_model_ref(ref: str | None) -> str:
    """Turn the ``--model`` value into what ``mlx_lm.load`` receives.

    Args:
        ref: A local folder or a Hugging Face id; ``None`` means the bundled model.

    Raises:
        ModelNotFoundError: ``ref`` is None and the bundled model is missing, or ``ref``
            is an existing path without a ``config.json``.
    """
    if ref is None:
        path = default_model_path()
        if not (path / "config.json").exists():
            raise ModelNotFoundError(
                f"no --model given and the bundled model is missing at {path}; "
                "pass --model <local folder or Hugging Face id>"
            )
        return str(path)
    path = Path(ref).expanduser()
    if path.exists():
        if not (path / "config.json").exists():
            raise ModelNotFoundError(f"--model {ref!r} is a path but holds no config.json")
        return str(path.resolve())
    return ref  # a hub id: mlx_lm.load downloads it (or finds it in the local HF cache)


def model_id_for(ref: str) -> str:
    """The id calibrations are registered under; the calibration registry decides when present."""
    try:
        from calibrations.registry import model_id_for as registry_model_id_for
    except ImportError:
        pass
    else:
        return registry_model_id_for(ref)
    config = Path(ref) / "config.json"
    if config.exists():
        name = json.loads(config.read_text()).get("_name_or_path")
        if name:
            return str(name)
        return Path(ref).name
    return ref


def context_length(config: dict[str, Any], tokenizer: Any) -> int:
    """The model's context length from its config, else the tokenizer's, else a default."""
    for key in _CONTEXT_KEYS:
        value = config.get(key)
        if isinstance(value, int) and value > 0:
            return value
    value = getattr(tokenizer, "model_max_length", None)
    # HF uses a huge sentinel when the tokenizer does not know.
    if isinstance(value, int) and 0 < value < 10_000_000:
        return value
    return DEFAULT_CONTEXT_LENGTH


def load_model(ref: str | None) -> LoadedModel:
    """Load ``ref`` (see :func:`resolve_model_ref`) with ``mlx_lm.load``.

    Must run on the thread that will generate with the model.
    """
    import mlx_lm

    source = resolve_model_ref(ref)
    # mlx_lm.load is typed as either a 2- or a 3-tuple; with return_config=True it is 3.
    model, tokenizer, config = cast(
        "tuple[nn.Module, TokenizerWrapper, dict[str, Any]]",
        mlx_lm.load(source, return_config=True),
    )
    model_id = model_id_for(source)
    # A local folder is served under its folder name (the bundled one: "qfserve-tiny").
    name = Path(source).name if Path(source).exists() else source
    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        model_id=model_id,
        source=source,
        context_length=context_length(config, tokenizer),
    )
    logger.info("loaded %s from %s (context %d)", loaded.name, source, loaded.context_length)
    return loaded
