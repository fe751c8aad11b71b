"""Convert a GGUF file to an mlx-lm folder once, and find it again on later starts.

The folder is ``<cache>/models/<name>/<sha256[:16]>-<variant>/`` (``<cache>`` is
``$QFSERVE_CACHE``, else ``$XDG_CACHE_HOME/qfserve``, else ``~/.cache/qfserve``), keyed by the
file's hash so a changed file is converted again. ``variant`` is ``codes`` (what the server
loads on every backend: quantized matrices as MLX affine codes at about the file's size, see
:mod:`qfserve.engine.models.gguf.codes`) or ``f32`` (every weight dequantized to float32: a
reference for tests). The folder holds ``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json`` and ``generation_config.json``, so it loads
unchanged with ``mlx_lm.load`` and ``mlx_lm.server``; ``qfserve.json`` records where it came
from and the name it is served under. It is written to a temporary folder and renamed into
place, so an interrupted conversion leaves nothing half-written behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from qfserve.calibrations.model_info import FINGERPRINT_KEY
from qfserve.engine.models.gguf.codes import GROUP_SIZE
from qfserve.engine.models.gguf.reader import (
    GGUFError,
    GGUFFile,
    load_weights,
    open_gguf,
    source_fingerprint,
)
from qfserve.engine.models.gguf.tokenizer import (
    build_tokenizer,
    stop_token_ids,
    token_id,
    tokenizer_config,
)

logger = logging.getLogger(__name__)

MARKER = "qfserve.json"
MARKER_FORMAT = 6  # 6: codes, float16 scales where exact enough, float32 on the output
GGUF_MAGIC = b"GGUF"


def cache_root() -> Path:
    """qfserve's cache folder: ``$QFSERVE_CACHE``, else ``$XDG_CACHE_HOME/qfserve``."""
    if os.environ.get("QFSERVE_CACHE"):
        return Path(os.environ["QFSERVE_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "qfserve"


def is_gguf(path: str | Path) -> bool:
    """``path`` is a file that starts with the GGUF magic (Ollama's blobs have no extension)."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as f:
        return f.read(4) == GGUF_MAGIC


def file_sha256(path: Path) -> str:
    """The file's sha256, remembered per (path, size, mtime) so a restart does not rehash."""
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    memo_file = cache_root() / "models" / "hashes.json"
    try:
        memo = json.loads(memo_file.read_text())
    except (OSError, ValueError):
        memo = {}
    if isinstance(memo, dict) and isinstance(memo.get(key), str):
        return str(memo[key])
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    sha = digest.hexdigest()
    memo = memo if isinstance(memo, dict) else {}
    memo[key] = sha
    try:
        memo_file.parent.mkdir(parents=True, exist_ok=True)
        _write_json_atomic(memo_file, memo)
    except OSError:  # a read-only cache still converts, it only rehashes next time
        pass
    return sha


def converted_folder(
    path: str | Path,
    *,
    name: str | None = None,
    model_id: str | None = None,
    dequantize: bool = False,
) -> Path:
    """The mlx-lm folder of a GGUF file, converting it on first use.

    Args:
        path: The GGUF file.
        name: The id the server lists it under (default: the file name without ``.gguf``).
        model_id: The id its calibrated Q-Filters are registered under (default: ``name``).
        dequantize: Store float32 weights (a reference for tests); default: codes.
    Returns:
        The folder, ready for ``mlx_lm.load``.
    Raises:
        GGUFError: the file cannot be served (see :func:`qfserve.engine.models.gguf.reader.open_gguf`,
            :func:`qfserve.engine.models.gguf.tokenizer.build_tokenizer`), or its tensors do not fit the
            model its metadata describes.
    """
    path = Path(path).expanduser().resolve()
    name = name or (path.name[:-5] if path.name.lower().endswith(".gguf") else path.name)
    model_id = model_id or name
    sha = file_sha256(path)
    folder = (
        cache_root() / "models" / _safe(name) / f"{sha[:16]}-{'f32' if dequantize else 'codes'}"
    )
    if _valid(folder, sha, model_id):
        return folder
    with refusing(path):
        file = open_gguf(path)
    folder.parent.mkdir(parents=True, exist_ok=True)
    # One conversion per name at a time: a second process waits, then finds the folder.
    with locked(folder.parent / ".lock"):
        if _valid(folder, sha, model_id):
            return folder
        for stale in folder.parent.glob(".converting-*"):  # left by a killed conversion
            shutil.rmtree(stale, ignore_errors=True)
        logger.info("converting %s to an mlx-lm folder (once): %s", path, folder)
        tmp = Path(tempfile.mkdtemp(prefix=".converting-", dir=folder.parent))
        try:
            with refusing(path):
                _write_folder(file, tmp, model_id=model_id, dequantize=dequantize)
                _check_loads(file, tmp)
            _write_json_atomic(
                tmp / MARKER,
                {
                    "format": MARKER_FORMAT,
                    "served_name": name,
                    "model_id": model_id,
                    "source": str(path),
                    "sha256": sha,
                    "variant": "f32" if dequantize else "codes",
                    "tensor_types": sorted(set(file.tensor_types.values())),
                },
            )
            if folder.exists():  # an older format or a damaged conversion of the same file
                shutil.rmtree(folder)
            tmp.rename(folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return folder


@contextlib.contextmanager
def refusing(path: Path) -> Iterator[None]:
    """Whatever a file's bytes make the readers raise is a refusal naming the file.

    The checks in :mod:`.reader` and :mod:`.tokenizer` name what they refuse; bytes they do
    not foresee (a string that is not UTF-8, merges naming pieces the vocabulary lacks, an
    array of the wrong length) surface as the libraries' own errors (``gguf``'s,
    ``tokenizers``', numpy's), which a user should see as one line about the file, not a
    traceback. The disk's errors (``OSError``) and memory's stay what they are.
    """
    try:
        yield
    except (GGUFError, OSError, MemoryError):
        raise
    except Exception as exc:  # noqa: BLE001 - see above: the file's bytes, not our code
        raise GGUFError(path, f"cannot be read: {type(exc).__name__}: {exc}") from exc


def _valid(folder: Path, sha: str, model_id: str) -> bool:
    try:
        recorded = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(recorded, dict)
        and recorded.get("sha256") == sha
        and recorded.get("format") == MARKER_FORMAT
        and recorded.get("model_id") == model_id  # the calibration id its config carries
    )


@contextlib.contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive advisory lock on ``path`` (a no-op where ``fcntl`` does not exist)."""
    try:
        import fcntl
    except ImportError:  # Windows
        yield
        return
    with path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _write_folder(file: GGUFFile, out: Path, *, model_id: str, dequantize: bool) -> None:
    import mlx.core as mx

    tokenizer = build_tokenizer(file)  # refuses unsupported vocabularies before any big write
    stops = stop_token_ids(file)
    config: dict[str, Any] = {
        "_name_or_path": model_id,
        **file.config,
        "bos_token_id": token_id(file, "bos"),
        "eos_token_id": stops,
        "torch_dtype": "float32",
        FINGERPRINT_KEY: source_fingerprint(file),
    }
    _write_json_atomic(out / "config.json", config)
    _write_json_atomic(out / "generation_config.json", {"eos_token_id": stops})
    _write_json_atomic(
        out / "tokenizer_config.json",
        tokenizer_config(file, config["max_position_embeddings"]),
    )
    tokenizer.save(str(out / "tokenizer.json"))
    weights = load_weights(file, dequantize=dequantize)
    quantization = _quantization(weights)
    if quantization:  # mlx-lm quantizes the layers that have scales, at their own bits
        config["quantization"] = quantization
        _write_json_atomic(out / "config.json", config)
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})


def _quantization(weights: dict[str, Any]) -> dict[str, Any]:
    """mlx-lm's ``quantization`` config: the most common bits as the default, and an entry
    for each layer of other bits (mlx-lm reads per-layer entries by the layer's path)."""
    bits = {
        key[: -len(".scales")]: weights[key[: -len("scales")] + "weight"].shape[-1]
        * 32
        // (value.shape[-1] * GROUP_SIZE)
        for key, value in weights.items()
        if key.endswith(".scales")
    }
    if not bits:
        return {}
    counts = list(bits.values())
    common = max(set(counts), key=counts.count)
    config: dict[str, Any] = {"group_size": GROUP_SIZE, "bits": common, "mode": "affine"}
    for layer, b in sorted(bits.items()):
        if b != common:
            config[layer] = {"group_size": GROUP_SIZE, "bits": b, "mode": "affine"}
    return config


def _check_loads(file: GGUFFile, folder: Path) -> None:
    """Every tensor has the shape mlx-lm's model expects (strict load, nothing evaluated)."""
    from mlx_lm.utils import load_model

    try:
        load_model(folder, lazy=True, strict=True)
    except (ValueError, KeyError) as exc:
        raise GGUFError(
            file.path,
            f"tensors do not match the {file.architecture} model its metadata describes: {exc}",
        ) from exc


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name) or "model"


def _write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.replace(path)
