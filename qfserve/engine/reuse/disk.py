"""Kept caches on disk (``--prompt-cache-dir``): one safetensors file per prompt-cache entry.

mlx-lm's ``save_prompt_cache`` / ``load_prompt_cache`` (0.32) save each layer's ``state``
arrays and rebuild caches by class name from its own module, so an eviction cache cannot go
through them: its settings (``meta_state``) and its scorer are not in ``state``, and its class
is not mlx-lm's. A file here holds the same per-layer ``state`` arrays (plus what a scorer
learned from its request: the fallback's frozen direction, a self-calibrated filter), and a JSON header with the entry's key (model, settings, filter
source, conversation name), its tokens, the model's weights fingerprint and each layer's class and
``meta_state``. Loading builds fresh caches for those settings with the server's own filters
(``make_caches``), then restores each layer's state into them; a file for other weights, of
another format or that does not restore is skipped, and the log names it. Files of format 1
(before keys named their conversation) are read as unnamed entries.

A server killed mid-write (``kill -9``, a power cut) must leave nothing a restart loads
wrongly: an entry is written under a temporary name carrying the writer's process id, flushed
to the disk, then renamed over its own name (atomic on POSIX), and the folder is flushed too.
From format 3 the header carries a SHA-256 of every array's bytes, checked on load, so a file
damaged afterwards (cut by a copy, a bad sector) is refused by name rather than restored. A
temporary file whose writer is gone is removed when a server next opens the folder.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable
from dataclasses import astuple
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np

from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.scorers import KeySVDScorer
from qfserve.engine.kv.selfcal import SelfCalibratingScorer

logger = logging.getLogger(__name__)

FORMAT = 3
SUFFIX = ".qfcache.safetensors"
TEMPORARY = ".tmp"  # a write in progress: <entry>.<pid>.tmp


def entry_name(key: tuple[Any, ...], tokens: list[int]) -> str:
    """The file name of an entry: a hash of its key and tokens."""
    digest = hashlib.sha1(json.dumps([list(key), list(tokens)]).encode()).hexdigest()
    return digest[:20] + SUFFIX


def settings_of(key: tuple[Any, ...]) -> CacheConfig:
    """The cache settings a key was made from (:func:`qfserve.engine.reuse.kept.cache_key`)."""
    names, values = list(CacheConfig.__dataclass_fields__), key[1:-2]
    if len(values) > len(names):
        raise ValueError(f"its key holds {len(values)} settings, this version knows {len(names)}")
    # Saved before the last settings existed (``positions``, then ``threshold``): those
    # take their defaults, by name.
    return CacheConfig(**dict(zip(names, values, strict=False)))


def save(
    folder: Path, key: tuple[Any, ...], tokens: list[int], caches: list[Any], fingerprint: str
) -> Path:
    """Write one entry (atomically: a temporary file, then a rename)."""
    arrays: dict[str, mx.array] = {}
    layers = []
    for i, cache in enumerate(caches):
        state = tuple(cache.state)
        # mlx-lm's KVCache.state ends with its integer offset: numbers go in the header.
        arrays.update({f"{i}.{j}": a for j, a in enumerate(state) if isinstance(a, mx.array)})
        numbers = {str(j): a for j, a in enumerate(state) if not isinstance(a, mx.array)}
        scorer = getattr(cache, "scorer", None)
        arrays.update({f"{i}.{name}": a for name, a in _learned(scorer).items()})
        meta = getattr(cache, "meta_state", None)
        layers.append(
            {
                "class": type(cache).__name__,
                "n_state": len(state),
                "numbers": numbers,
                "meta_state": None if meta is None else list(meta),
                "source": getattr(scorer, "source", None),
            }
        )
    header = {
        "format": FORMAT,
        "key": list(key),
        "tokens": list(tokens),
        "fingerprint": fingerprint,
        "layers": layers,
        "sha256": checksum(arrays),
    }
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / entry_name(key, tokens)
    tmp = path.with_name(f"{path.name}.{os.getpid()}{TEMPORARY}")
    try:
        # mx.save_safetensors appends ".safetensors" to a name without it: write to an
        # open file instead, which also lets it be flushed before the rename.
        with tmp.open("wb") as out:
            mx.save_safetensors(out, arrays, {"qfserve": json.dumps(header)})
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _sync_folder(folder)
    return path


def checksum(arrays: dict[str, mx.array]) -> str:
    """SHA-256 over the arrays' names, dtypes, shapes and bytes, in name order."""
    digest = hashlib.sha256()
    for name in sorted(arrays):
        a = arrays[name]
        digest.update(f"{name}:{a.dtype}:{list(a.shape)};".encode())
        digest.update(np.asarray(mx.contiguous(a).view(mx.uint8)).tobytes())
    return digest.hexdigest()


def _sync_folder(folder: Path) -> None:
    """Flush the folder's entries (the rename) to the disk, where the platform allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_orphans(folder: Path) -> list[Path]:
    """Delete temporary files whose writing process is gone (killed mid-write); returns them.
    Another live server's writes in progress are left alone."""
    removed = []
    for tmp in folder.glob(f"*{SUFFIX}.*{TEMPORARY}"):
        pid = tmp.name.removesuffix(TEMPORARY).rsplit(".", 1)[-1]
        if pid.isdigit() and _alive(int(pid)) and int(pid) != os.getpid():
            continue
        tmp.unlink(missing_ok=True)
        removed.append(tmp)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def load(
    path: Path, fingerprint: str, fresh: Callable[[CacheConfig], list[Any]]
) -> tuple[tuple[Any, ...], list[int], list[Any]]:
    """Read one entry back into fresh caches (``fresh`` builds them for its settings).

    Raises:
        ValueError: another format or other weights, or a layer that does not match.
    """
    loaded = mx.load(str(path), return_metadata=True)
    arrays, meta = cast("tuple[dict[str, mx.array], dict[str, str]]", loaded)
    header = json.loads(meta["qfserve"])
    if header.get("format") not in (1, 2, FORMAT):
        raise ValueError(f"format {header.get('format')!r}, expected {FORMAT}")
    if header["fingerprint"] != fingerprint:
        raise ValueError("saved for other weights (the model's fingerprint differs)")
    if header["format"] >= 3 and header.get("sha256") != checksum(arrays):
        raise ValueError("its arrays do not match their checksum (the file is damaged)")
    key = tuple(header["key"]) + ((None,) if header["format"] == 1 else ())
    settings = settings_of(key)
    key = (key[0], *astuple(settings), *key[-2:])  # as this version's keys are made
    caches = fresh(settings)
    if len(caches) != len(header["layers"]):
        raise ValueError(f"{len(header['layers'])} layers saved, the model has {len(caches)}")
    for i, (cache, layer) in enumerate(zip(caches, header["layers"], strict=True)):
        if type(cache).__name__ != layer["class"]:
            raise ValueError(f"layer {i} was a {layer['class']}, now {type(cache).__name__}")
        numbers = layer.get("numbers", {})
        if not isinstance(numbers, dict) or not all(
            type(v) is int for v in numbers.values()
        ):  # mlx-lm's caches keep only integers (an offset) beside their arrays
            raise ValueError(f"layer {i}: its state's numbers are not integers")
        cache.state = tuple(
            numbers[str(j)] if str(j) in numbers else arrays[f"{i}.{j}"]
            for j in range(layer["n_state"])
        )
        _check_rows(i, cache.state)
        if layer["meta_state"] is not None:
            cache.meta_state = tuple(layer["meta_state"])
        for name in ("direction", "filters"):
            if f"{i}.{name}" in arrays:
                setattr(cache.scorer, name, arrays[f"{i}.{name}"])
        if isinstance(getattr(cache, "scorer", None), SelfCalibratingScorer) and layer.get(
            "source"
        ):
            cache.scorer.source = layer["source"]  # "fallback" where no prompt block came first
    return key, list(header["tokens"]), caches


def _check_rows(i: int, state: Any) -> None:
    """A restored layer's keys and values are rows: ``(B, H, S, D)`` arrays that agree (a
    header that put anything else there would fail only at the next request's step)."""
    if not state:
        return
    keys, values = state[0], state[1] if len(state) > 1 else None
    if not (isinstance(keys, mx.array) and isinstance(values, mx.array)):
        raise ValueError(f"layer {i}: its keys and values are not arrays")
    if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != values.shape[:3]:
        raise ValueError(f"layer {i}: keys {keys.shape} and values {values.shape} are not rows")


def _learned(scorer: Any) -> dict[str, mx.array]:
    """What a scorer learned from its own request, which fresh caches cannot rebuild."""
    if isinstance(scorer, KeySVDScorer) and scorer.direction is not None:
        return {"direction": scorer.direction}
    if isinstance(scorer, SelfCalibratingScorer) and scorer.filters is not None:
        return {"filters": scorer.filters}
    return {}


def load_folder(
    folder: Path, fingerprint: str, fresh: Callable[[CacheConfig], list[Any]], limit: int
) -> list[tuple[tuple[Any, ...], list[int], list[Any]]]:
    """The ``limit`` most recent entries of ``folder`` that restore, oldest first (files
    for other weights stay where they are, for the server they belong to)."""
    if not folder.is_dir():
        return []
    for tmp in remove_orphans(folder):
        logger.warning("removed %s: a write its server did not finish", tmp)

    def mtime(path: Path) -> float:
        try:
            return path.stat().st_mtime
        except OSError:  # gone since the glob (another server pruned it)
            return 0.0

    out: list[tuple[tuple[Any, ...], list[int], list[Any]]] = []
    for path in sorted(folder.glob("*" + SUFFIX), key=mtime, reverse=True):
        if len(out) == limit:
            break
        try:
            out.append(load(path, fingerprint, fresh))
        except Exception as exc:  # noqa: BLE001 - a bad file must not stop the server
            logger.warning("skipping saved cache %s: %s", path, exc)
    return out[::-1]


def prune(folder: Path, mine: set[str], keep: set[str]) -> None:
    """Delete the files this server wrote or loaded (``mine``) that are not in ``keep``."""
    for name in mine - keep:
        (folder / name).unlink(missing_ok=True)
