"""Find a model's calibrated Q-Filters by model id, across a search path, with aliases.

An artifact for model ``org/name`` is the file ``org--name.safetensors`` (other characters
outside ``[A-Za-z0-9._-]`` become ``_``). Folders are searched in this order, first hit wins:

1. ``search_dirs`` passed by the caller;
2. the folders in ``$QFSERVE_CALIBRATIONS`` (``os.pathsep``-separated);
3. the user folder, ``$XDG_CACHE_HOME/qfserve/calibrations`` (default ``~/.cache/...``),
   where ``qfserve calibrate`` writes by default;
4. the artifacts shipped with qfserve, ``qfserve/calibrations/artifacts/``.

Aliases map one id to another whose filters it shares, e.g. a quantised
``mlx-community/...-4bit`` id to its base model. They come from ``qfserve/calibrations/aliases.json``
and from an ``aliases.json`` in any searched folder (earlier folders win). An exact artifact
always beats an alias.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

from safetensors import safe_open

from qfserve.calibrations.artifact import Calibration, load_calibration

ENV_VAR = "QFSERVE_CALIBRATIONS"
PACKAGE_DIR = Path(__file__).resolve().parent
BUILTIN_DIR = PACKAGE_DIR / "artifacts"
ALIASES_FILE = PACKAGE_DIR / "aliases.json"
SUFFIX = ".safetensors"
SURROGATE_SUFFIX = ".kvzap"  # KVzap's surrogates (safetensors inside; not a Q-Filters artifact)
_MAX_ALIAS_HOPS = 8


class CalibrationNotFoundError(LookupError):
    """No artifact exists for a model id (nor for what it is an alias of)."""


def user_dir() -> Path:
    """The per-user calibration folder (created by ``qfserve calibrate`` when needed)."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "qfserve" / "calibrations"


def default_output_dir() -> Path:
    """Where ``qfserve calibrate`` writes: the first ``$QFSERVE_CALIBRATIONS`` folder, else
    :func:`user_dir`. Both are on the search path."""
    env = [d for d in os.environ.get(ENV_VAR, "").split(os.pathsep) if d]
    return Path(env[0]).expanduser() if env else user_dir()


def search_path(search_dirs: Sequence[str | Path] | None = None) -> list[Path]:
    """The folders searched, in order (see the module docstring); duplicates removed."""
    env = [d for d in os.environ.get(ENV_VAR, "").split(os.pathsep) if d]
    dirs = [*(search_dirs or ()), *env, user_dir(), BUILTIN_DIR]
    out: list[Path] = []
    for d in dirs:
        p = Path(d).expanduser()
        if p not in out:
            out.append(p)
    return out


def artifact_name(model_id: str) -> str:
    """The file name of ``model_id``'s artifact: ``org/name`` -> ``org--name.safetensors``."""
    if not model_id or not model_id.strip("/"):
        raise ValueError(f"model_id must be a non-empty id, got {model_id!r}")
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", model_id.strip("/").replace("/", "--"))
    return stem + SUFFIX


def surrogate_name(model_id: str) -> str:
    """The file name of ``model_id``'s KVzap surrogates: ``org--name.kvzap``."""
    return artifact_name(model_id)[: -len(SUFFIX)] + SURROGATE_SUFFIX


def find_surrogate(
    model_id: str, *, search_dirs: Sequence[str | Path] | None = None
) -> Path | None:
    """The KVzap surrogate file for ``model_id`` (or the model it is an alias of), searched
    as Q-Filters artifacts are; ``None`` when there is none."""
    dirs = search_path(search_dirs)
    for candidate in _alias_chain(model_id, aliases(search_dirs)):
        for d in dirs:
            if (d / surrogate_name(candidate)).is_file():
                return d / surrogate_name(candidate)
    return None


def aliases(search_dirs: Sequence[str | Path] | None = None) -> dict[str, str]:
    """The merged alias table ``{id: target id}``.

    Raises:
        ValueError: an ``aliases.json`` is not a JSON object of strings (naming the file).
    """
    table: dict[str, str] = {}
    # Lowest priority first, so earlier search folders override later ones and the package.
    for f in [ALIASES_FILE, *(d / "aliases.json" for d in reversed(search_path(search_dirs)))]:
        if not f.is_file():
            continue
        try:
            data = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"alias table {f} is not valid JSON: {e}") from None
        entries = (
            {k: v for k, v in data.items() if not k.startswith("_")}
            if isinstance(data, dict)
            else None
        )
        if entries is None or not all(isinstance(v, str) for v in entries.values()):
            raise ValueError(f"alias table {f} must be a JSON object of id -> id strings")
        table.update(entries)
    return table


def _alias_chain(model_id: str, table: dict[str, str]) -> list[str]:
    chain = [model_id]
    while chain[-1] in table and len(chain) <= _MAX_ALIAS_HOPS:
        target = table[chain[-1]]
        if target in chain:
            break  # a cycle: stop rather than loop
        chain.append(target)
    return chain


def _stored_id(path: Path) -> str:
    """The model id inside an artifact; from the file name if it stores none or is unreadable."""
    try:
        with safe_open(str(path), framework="numpy") as f:
            stored = (f.metadata() or {}).get("model_id")
    except Exception:
        stored = None
    return stored or path.name[: -len(SUFFIX)].replace("--", "/")


def available(search_dirs: Sequence[str | Path] | None = None) -> list[str]:
    """Sorted ids of every artifact on the search path (aliases not included)."""
    ids: set[str] = set()
    for d in search_path(search_dirs):
        if d.is_dir():
            ids.update(_stored_id(p) for p in d.glob("*" + SUFFIX) if not p.name.startswith("."))
    return sorted(ids)


def _locate(
    model_id: str, search_dirs: Sequence[str | Path] | None
) -> tuple[Path | None, list[str]]:
    chain = _alias_chain(model_id, aliases(search_dirs))
    dirs = search_path(search_dirs)
    for candidate in chain:
        name = artifact_name(candidate)
        for d in dirs:
            if (d / name).is_file():
                return d / name, chain
    return None, chain


def find(model_id: str, *, search_dirs: Sequence[str | Path] | None = None) -> Path:
    """The artifact file for ``model_id`` (or for the model it is an alias of).

    Raises:
        CalibrationNotFoundError: none exists; the message lists what does.
    """
    path, chain = _locate(model_id, search_dirs)
    if path is None:
        via = f" (alias of {' -> '.join(repr(c) for c in chain[1:])})" if len(chain) > 1 else ""
        have = available(search_dirs)
        raise CalibrationNotFoundError(
            f"no calibrated Q-Filters for model {model_id!r}{via}; looked for "
            f"{artifact_name(chain[-1])} in {[str(d) for d in search_path(search_dirs)]}. "
            f"Available: {have or 'none'}. Make one with `qfserve calibrate --model <id or path>`."
        )
    return path


def load_for_model(
    model_id: str,
    *,
    n_layers: int,
    n_kv_heads: int,
    head_dim: int,
    weights: str = "",
    search_dirs: Sequence[str | Path] | None = None,
) -> Calibration | None:
    """Load and check the calibration of a model, or ``None`` when it has none.

    Args:
        model_id: The model's id (see :func:`model_id_for`).
        n_layers, n_kv_heads, head_dim: The model's attention shape.
        weights: The model's weights fingerprint (checked when the file records one).
        search_dirs: Folders searched before the default search path.
    Returns:
        The :class:`~qfserve.calibrations.artifact.Calibration`, or ``None`` when no artifact exists.
    Raises:
        CalibrationError: an artifact exists but is for another model (or other weights of
            it), has the wrong shape, or is truncated, corrupt or non-finite. Never silently skipped.
    """
    path, chain = _locate(model_id, search_dirs)
    if path is None:
        return None
    return load_calibration(
        path,
        model_id=model_id,
        accept_ids=chain[1:],
        n_layers=n_layers,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        weights=weights,
    )


def _looks_like_path(value: str) -> bool:
    return (
        value.startswith(("/", ".", "~"))
        or "\\" in value
        or value.count("/") > 1
        or Path(value).exists()
    )


def model_id_for(path_or_id: str | Path) -> str:
    """The id a model's calibration is registered under.

    * a Hugging Face id (anything that is not an existing folder) is itself;
    * a folder in the Hugging Face cache (``.../models--org--name/snapshots/<rev>``) is
      ``org/name``;
    * another folder is its ``config.json``'s ``_name_or_path`` when that is an id rather
      than a path, else the folder's name.
    """
    text = str(path_or_id)
    path = Path(text).expanduser()
    if not path.is_dir():
        return text
    path = path.resolve()
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name[len("models--") :].replace("--", "/")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        config = {}
    name = config.get("_name_or_path") if isinstance(config, dict) else None
    if isinstance(name, str) and name.strip() and not _looks_like_path(name.strip()):
        return name.strip()
    return path.name
