"""Find and load the model a server runs: a GGUF file, a local folder, a Hugging Face id, a
catalog name (the default, ``smollm2-135m-instruct``) or the bundled ``qfserve-tiny``.

Loading goes through ``mlx_lm.load``; a GGUF file is first converted to an mlx-lm folder
once (:mod:`qfserve.engine.models.gguf.convert`). This module only decides *what* to load, which id the
calibrated Q-Filters are looked up under, and how long a context the model accepts.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    import mlx.nn as nn
    from mlx_lm.tokenizer_utils import TokenizerWrapper

logger = logging.getLogger(__name__)

BUNDLED_NAME = "qfserve-tiny"
# The bundled tiny model lives in the source tree's models/ folder.
DEFAULT_MODEL_DIR = Path(__file__).resolve().parents[3] / "models" / BUNDLED_NAME
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
    """The bundled model is missing, or a named path does not exist or is not a model."""


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
        config: The model's ``config.json``.
    """

    model: Any
    tokenizer: Any
    name: str
    model_id: str
    source: str
    context_length: int
    config: dict[str, Any] = field(default_factory=dict)


def default_model_path() -> Path:
    """The bundled model folder (``models/qfserve-tiny`` at the repository root)."""
    return DEFAULT_MODEL_DIR


def resolve_model_ref(ref: str | None) -> str:
    """Turn the ``--model`` value into what ``mlx_lm.load`` receives, converting and fetching
    what needs it (a GGUF file is converted once; a catalog model is downloaded once).

    Args:
        ref: ``None`` (the default catalog model), a catalog name, ``qfserve-tiny``, a GGUF
            file, a local mlx-lm folder or a Hugging Face id.
    Raises:
        ModelNotFoundError: the bundled model is missing, a path does not exist, or it is
            neither a GGUF file nor a folder with a ``config.json``.
        qfserve.engine.models.gguf.GGUFError: a GGUF file qfserve cannot serve (the message names it).
        qfserve.engine.models.catalog.ModelFetchError: a catalog model is not cached and cannot be fetched.
    """
    from qfserve.engine.models import catalog

    ref = catalog.DEFAULT_MODEL if ref is None else ref
    # Names first, so a file of that name in the working directory cannot take their place.
    if ref == BUNDLED_NAME:
        if not (default_model_path() / "config.json").exists():
            raise ModelNotFoundError(
                f"the bundled model {BUNDLED_NAME} is missing at {default_model_path()}"
            )
        return str(default_model_path())
    if ref in catalog.CATALOG:
        return str(catalog.folder_for(catalog.CATALOG[ref]))
    path = Path(ref).expanduser()
    if not path.exists():
        if ref.startswith(("/", ".", "~")) or ref.lower().endswith(".gguf") or ref.count("/") > 1:
            raise ModelNotFoundError(f"--model {ref!r} looks like a path, but nothing is there")
        if ":" in ref:
            raise ModelNotFoundError(
                f"--model {ref!r} looks like an Ollama tag; qfserve reads the GGUF file itself: "
                "pass the blob's path (~/.ollama/models/blobs/sha256-...)"
            )
        if ref.lower().endswith("-gguf"):
            raise ModelNotFoundError(
                f"--model {ref!r} looks like a hub repository of GGUF files; download one "
                ".gguf file and pass its path"
            )
        _fetch_from_hub(ref)
        return ref  # a hub id, now in the local Hugging Face cache, where mlx_lm.load finds it
    if path.is_file():
        from qfserve.engine.models.gguf.convert import converted_folder, file_sha256, is_gguf

        if not is_gguf(path):
            raise ModelNotFoundError(f"--model {ref!r} is a file but not a GGUF file")
        known = catalog.by_gguf_sha256(file_sha256(path))
        if known is not None:
            return str(converted_folder(path, name=known.name, model_id=known.model_id))
        return str(converted_folder(path))
    if not (path / "config.json").exists():
        raise ModelNotFoundError(f"--model {ref!r} is a folder but holds no config.json")
    return str(path.resolve())


def served_name(source: str) -> str:
    """The id ``/v1/models`` lists: a converted GGUF's recorded name, a folder's name, or
    the hub id."""
    from qfserve.engine.models.gguf.convert import MARKER

    path = Path(source)
    if not path.exists():
        return source
    try:
        name = json.loads((path / MARKER).read_text()).get("served_name")
    except (OSError, ValueError, AttributeError):
        name = None
    return str(name) if isinstance(name, str) and name else path.name


def model_id_for(ref: str) -> str:
    """The id calibrations are registered under; the calibration registry decides when present."""
    try:
        from qfserve.calibrations.registry import model_id_for as registry_model_id_for
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
    _attach_codes(model, source)
    from qfserve.engine.models.memory import release_memory, resident_bytes
    from qfserve.engine.models.quantized import weight_bytes

    loaded = LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=served_name(source),
        model_id=model_id_for(source),
        source=source,
        context_length=context_length(config, tokenizer),
        config=config,
    )
    # The server measures prompts against the context length itself (a clear 400). Left
    # at the model's length, the Hugging Face tokenizer also logs "will result in indexing
    # errors" for every over-long prompt it encodes, a prompt the server then refuses.
    hf = getattr(tokenizer, "_tokenizer", None)
    if hf is not None and hasattr(hf, "model_max_length"):
        hf.model_max_length = sys.maxsize
    release_memory()  # what loading and attaching freed
    logger.info(
        "loaded %s from %s (context %d; weights %.1f MiB as held, resident %.1f MiB)",
        loaded.name,
        source,
        loaded.context_length,
        weight_bytes(model) / 2**20,
        resident_bytes() / 2**20,
    )
    return loaded


def _attach_codes(model: nn.Module, source: str) -> None:
    """On MLX's CPU backend, products on the quantized layers' codes through the native
    kernel, or float32 layers where it cannot be built
    (:mod:`qfserve.engine.models.quantized`); Metal keeps MLX's own quantized kernels."""
    import mlx.core as mx

    from qfserve.engine.models.gguf.convert import cache_root

    if mx.default_device().type != mx.DeviceType.cpu:
        return
    from qfserve.engine.models.quantized import attach
    from qfserve.kernels import native

    attach(model, native.load(cache_root() / "native"))


def served_as(loaded: LoadedModel, alias: str | None, ctx_size: int | None) -> LoadedModel:
    """``loaded`` listed as ``alias`` and serving at most ``ctx_size`` tokens a request
    (llama-server's ``--alias`` and ``--ctx-size``); ``None`` keeps the model's own.

    Raises:
        ValueError: ``ctx_size`` exceeds the context the model was trained for.
    """
    if ctx_size is not None and ctx_size > loaded.context_length:
        raise ValueError(
            f"--ctx-size {ctx_size} exceeds {loaded.name}'s context length {loaded.context_length}"
        )
    return dataclasses.replace(
        loaded,
        name=alias or loaded.name,
        context_length=ctx_size or loaded.context_length,
    )


def gguf_alias(ref: str | None) -> str | None:
    """The name a GGUF file given by path is served under: its file name without
    ``.gguf`` (``None`` for anything else)."""
    if ref is None or not ref.lower().endswith(".gguf"):
        return None
    return Path(ref).name[: -len(".gguf")] or None


def _fetch_from_hub(ref: str) -> None:
    """Find a hub model's files in the local Hugging Face cache or download them, with the
    patterns mlx-lm loads, before the server binds its port: an unknown id, or one that is
    not cached on a machine without network, is then one clear error at start-up instead of
    a server that binds, reports itself running and dies on its model thread.

    Raises:
        ModelNotFoundError: the files are neither cached nor fetchable (the reason named).
    """
    from huggingface_hub import snapshot_download
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    try:
        snapshot_download(ref, allow_patterns=DEFAULT_ALLOW_PATTERNS)
    except Exception as exc:  # noqa: BLE001 - hub, network and cache errors alike
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise ModelNotFoundError(
            f"--model {ref!r}: not in the local Hugging Face cache and cannot be fetched "
            f"({type(exc).__name__}{': ' + reason if reason else ''})"
        ) from None
