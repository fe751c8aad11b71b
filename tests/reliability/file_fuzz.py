"""Mutated calibration and kept-cache files through the readers start-up uses.

Both are safetensors files (an 8-byte header length, a JSON header, the arrays' bytes). A
corpus is built from one valid file of each kind (:func:`bases`) by seeded mutations
(:data:`MUTATIONS`): truncation inside the header and the data, flipped bytes, the header
length, dtypes, shapes and data offsets rewritten to absurd values, the metadata (format
version, model id, the kept cache's key, tokens and layers) rewritten, and NaN or infinite
values under valid metadata. :func:`verdict` reads each as start-up does and sorts the
outcome:

- a calibration (:func:`qfserve.calibrations.artifact.read_calibration`, then
  :func:`~qfserve.calibrations.artifact.check_calibration` against the bundled model's
  shape): ``refused`` (a ``CalibrationError``: the server exits 2 with one line naming the
  file) or ``read`` (valid: finite unit filters of the model's shape);
- a kept cache (:func:`qfserve.engine.reuse.disk.load`): ``refused`` (it raises; the server
  skips the file, naming it in one log line) or ``read`` (restored: the caches rebuilt for
  its settings, each layer's rows matching its class);
- ``slow`` (either, after more than :data:`LIMIT_S`) and ``crash`` (a calibration raising
  anything else, or anything read that is not what it should be).

``python -m tests.reliability.file_fuzz KIND N`` runs a corpus in its own process and prints
a JSON summary, so a crash in native code fails its caller rather than killing it.
"""

from __future__ import annotations

import json
import math
import random
import struct
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

LIMIT_S = 5.0
FINGERPRINT = "fuzz"


def bases(folder: Path) -> dict[str, Path]:
    """One valid calibration and one valid kept cache, for the bundled model."""
    import mlx.core as mx

    from qfserve.calibrations.artifact import save_calibration
    from qfserve.engine.kv.config import CacheConfig
    from qfserve.engine.kv.factory import make_caches
    from qfserve.engine.models.loading import default_model_path, load_model
    from qfserve.engine.reuse import disk
    from qfserve.engine.reuse.kept import cache_key

    folder.mkdir(parents=True, exist_ok=True)
    L, H, D = model_shape()
    rng = np.random.default_rng(0)
    calibration = save_calibration(
        folder / "calibration.safetensors",
        rng.standard_normal((L, H, D)).astype(np.float32),
        model_id="fuzz/model",
        n_sequences=1,
        tokens_per_sequence=16,
        samples_per_head=16,
        text="fuzz",
        query_scale=np.ones((L, H), dtype=np.float32),
    )
    loaded = load_model(str(default_model_path()))
    config = CacheConfig(method="qfilters", budget=24, recent=4, chunk=4)
    caches = make_caches(loaded.model, config)
    tokens = list(range(5, 45))
    loaded.model(mx.array(tokens)[None], cache=caches)
    kept = disk.save(
        folder / "kept", cache_key("fuzz", config, "fallback"), tokens, caches, FINGERPRINT
    )
    return {"calibration": Path(calibration), "cache": kept}


def model_shape() -> tuple[int, int, int]:
    from qfserve.engine.models.loading import default_model_path

    c = json.loads((default_model_path() / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    return c["num_hidden_layers"], c.get("num_key_value_heads", c["num_attention_heads"]), head_dim


# -- mutations ---------------------------------------------------------------------------------


def _split(data: bytes) -> tuple[int, dict[str, Any], bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return n, json.loads(data[8 : 8 + n]), data[8 + n :]


def _join(header: dict[str, Any], body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def _absurd(rng: random.Random) -> Any:
    return rng.choice((-1, 0, 2**31 - 1, 2**32, 2**63 - 1, 10**12, 1.5, "x", None, [], {}))


def truncate(data: bytes, rng: random.Random) -> bytes:
    n, _, _ = _split(data)
    cut = rng.choice(
        (rng.randrange(0, 8), rng.randrange(8, 8 + n), rng.randrange(8 + n, len(data)))
    )
    return data[:cut]


def flip_bytes(data: bytes, rng: random.Random) -> bytes:
    out = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        out[rng.randrange(len(out))] ^= 1 << rng.randrange(8)
    return bytes(out)


def header_length(data: bytes, rng: random.Random) -> bytes:
    n = rng.choice((0, 1, 7, len(data), len(data) * 4, 2**40, 2**63 - 1))
    return struct.pack("<Q", n) + data[8:]


def tensor_entry(data: bytes, rng: random.Random) -> bytes:
    _, header, body = _split(data)
    name = rng.choice([k for k in header if k != "__metadata__"])
    field = rng.choice(("dtype", "shape", "data_offsets"))
    entry = header[name]
    if field == "dtype":
        entry["dtype"] = rng.choice(("F64", "I8", "BOOL", "U64", "F8_E4M3", "Q4_0", "", 7))
    elif field == "shape":
        entry["shape"] = [_absurd(rng) if rng.random() < 0.5 else d for d in entry["shape"]] or [
            _absurd(rng)
        ]
    else:
        a, b = entry["data_offsets"]
        entry["data_offsets"] = rng.choice(([b, a], [a, b + 4096], [a, 2**62], [-8, b], [a]))
    return _join(header, body)


def drop_tensor(data: bytes, rng: random.Random) -> bytes:
    _, header, body = _split(data)
    del header[rng.choice([k for k in header if k != "__metadata__"])]
    return _join(header, body)


def metadata(data: bytes, rng: random.Random) -> bytes:
    _, header, body = _split(data)
    meta = header.setdefault("__metadata__", {})
    if "qfserve" in meta:  # a kept cache: its JSON header inside the metadata
        inner = json.loads(meta["qfserve"])
        field = rng.choice(("format", "key", "tokens", "layers", "fingerprint", "sha256"))
        if field == "layers" and inner["layers"] and rng.random() < 0.7:
            layer = rng.choice(inner["layers"])
            part = rng.choice(("class", "n_state", "numbers", "meta_state"))
            layer[part] = rng.choice(
                (_absurd(rng), ["-5", "x"], {"0": "x"}, ["1"] * 9, "EvictionCache")
            )
        elif field == "key":
            key = inner["key"]
            key[rng.randrange(len(key))] = _absurd(rng)
        elif field == "tokens":
            inner["tokens"] = rng.choice(([], [-1, 2**40], ["a"], list(range(10**5)), None))
        else:
            inner[field] = _absurd(rng)
        meta["qfserve"] = json.dumps(inner) if rng.random() < 0.9 else "{not json"
    else:
        field = rng.choice([*meta, "format_version", "model_id"])
        meta[field] = rng.choice(("", "99", "-1", "nan", "x" * 10**5, "2", "1"))
    return _join(header, body)


def non_finite(data: bytes, rng: random.Random) -> bytes:
    _, header, body = _split(data)
    floats = [e for k, e in header.items() if k != "__metadata__" and e["dtype"] == "F32"]
    entry = rng.choice(floats)
    a, b = entry["data_offsets"]
    out = bytearray(body)
    at = a + 4 * rng.randrange(max(1, (b - a) // 4))
    out[at : at + 4] = struct.pack("<f", rng.choice((math.nan, math.inf, -math.inf)))
    return _join(header, bytes(out))


MUTATIONS: dict[str, Callable[[bytes, random.Random], bytes]] = {
    "truncate": truncate,
    "flip_bytes": flip_bytes,
    "header_length": header_length,
    "tensor_entry": tensor_entry,
    "drop_tensor": drop_tensor,
    "metadata": metadata,
    "non_finite": non_finite,
}


# -- reading them back -------------------------------------------------------------------------


def verdict(kind: str, path: Path) -> tuple[str, float, str]:
    """(outcome, seconds, message) of reading ``path`` as start-up does (module docstring)."""
    tic = time.perf_counter()
    try:
        message = _read(kind, path)
    except _Refused as refused:
        seconds = time.perf_counter() - tic
        return ("refused" if seconds <= LIMIT_S else "slow"), seconds, str(refused)
    except Exception:  # noqa: BLE001 - what the fuzzer looks for
        return "crash", time.perf_counter() - tic, traceback.format_exc()
    seconds = time.perf_counter() - tic
    return ("read" if seconds <= LIMIT_S else "slow"), seconds, message


class _Refused(Exception):  # noqa: N818 - an outcome, not an error
    pass


def _read(kind: str, path: Path) -> str:
    if kind == "calibration":
        from qfserve.calibrations.artifact import (
            CalibrationError,
            check_calibration,
            read_calibration,
        )

        L, H, D = model_shape()
        try:
            c = check_calibration(
                read_calibration(path), model_id="fuzz/model", n_layers=L, n_kv_heads=H, head_dim=D
            )
        except CalibrationError as exc:
            raise _Refused(str(exc)) from None
        filters = np.asarray(c.filters)
        assert filters.shape == (L, H, D) and np.isfinite(filters).all(), "read but not valid"
        assert np.allclose(np.linalg.norm(filters, axis=-1), 1, atol=1e-3), "not unit rows"
        return "read"
    from qfserve.engine.kv.factory import make_caches
    from qfserve.engine.models.loading import default_model_path, load_model
    from qfserve.engine.reuse import disk

    model = _model(load_model, default_model_path)
    try:
        key, tokens, caches = disk.load(path, FINGERPRINT, lambda cfg: make_caches(model, cfg))
    except Exception as exc:  # noqa: BLE001 - load_folder skips any error, naming the file
        raise _Refused(f"{type(exc).__name__}: {exc}") from None
    for cache in caches:  # restored: each layer holds rows of the model's shape
        keys = cache.state[0]
        assert keys.ndim == 4 and keys.shape[3] == model_shape()[2], "rows of another shape"
    return f"read {len(tokens)} tokens"


_MODEL: list[Any] = []


def _model(load_model: Any, default_model_path: Any) -> Any:
    if not _MODEL:
        _MODEL.append(load_model(str(default_model_path())).model)
    return _MODEL[0]


def run(kind: str, n: int, folder: Path, seed: int = 0) -> dict[str, Any]:
    """``n`` mutants of ``kind``'s base file; the counts of each outcome and every crash."""
    base = bases(folder)[kind]
    data = base.read_bytes()
    rng = random.Random(seed)
    names = sorted(MUTATIONS)
    outcomes: dict[str, int] = {}
    crashes, slowest = [], 0.0
    out = folder / f"mutant-{kind}.safetensors"
    for i in range(n):
        mutation = names[i % len(names)]
        out.write_bytes(MUTATIONS[mutation](data, rng))
        outcome, seconds, message = verdict(kind, out)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        slowest = max(slowest, seconds)
        if outcome in ("crash", "slow"):
            crashes.append({"index": i, "mutation": mutation, "message": message[-2000:]})
    return {
        "kind": kind,
        "files": n,
        "outcomes": outcomes,
        "slowest_s": slowest,
        "crashes": crashes,
    }


if __name__ == "__main__":
    import tempfile

    kind, n = sys.argv[1], int(sys.argv[2])
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    with tempfile.TemporaryDirectory() as tmp:
        print(json.dumps(run(kind, n, Path(tmp), seed)))
