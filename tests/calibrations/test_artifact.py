"""Artifacts: round trip, and every way a file can be wrong raises, naming the file."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from safetensors.numpy import save_file

from qfserve.calibrations.artifact import (
    FORMAT_NAME,
    CalibrationError,
    load_calibration,
    read_calibration,
    save_calibration,
)

SHAPE = (2, 2, 32)
MODEL = "test/tiny-llama"
SUMMARY = [
    {"layer": 0, "positive_share": 1.0, "top_energy": 0.4, "drift_ratio": 9.0},
    {"layer": 1, "positive_share": 0.5, "top_energy": 0.2, "drift_ratio": 3.0},
]


def _at(path) -> str:
    """Regex matching the file name in an error message."""
    return re.escape(str(path))


def _filters(seed: int = 0) -> np.ndarray:
    f = np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)
    return f / np.linalg.norm(f, axis=-1, keepdims=True)


def _save(path, filters=None, **overrides):
    kwargs = dict(
        model_id=MODEL,
        n_sequences=2,
        tokens_per_sequence=128,
        samples_per_head=256,
        text="unit test text",
        anisotropy=SUMMARY,
    )
    filters = _filters() if filters is None else filters
    kwargs.setdefault("query_scale", np.full(np.shape(filters)[:2], 2.5, dtype=np.float32))
    kwargs.update(overrides)
    return save_calibration(path, filters, **kwargs)


def _raw_metadata(**overrides) -> dict[str, str]:
    meta = {
        "format": FORMAT_NAME,
        "format_version": "1",
        "model_id": MODEL,
        "n_sequences": "2",
        "tokens_per_sequence": "128",
        "samples_per_head": "256",
        "text": "t",
        "post_rope": "true",
        "created": "2025-01-01T00:00:00+00:00",
        "anisotropy": "[]",
    }
    meta.update(overrides)
    return meta


def test_round_trip(tmp_path):
    path = _save(tmp_path / "sub" / "a.safetensors")
    cal = load_calibration(path, model_id=MODEL, n_layers=2, n_kv_heads=2, head_dim=32)
    np.testing.assert_allclose(cal.filters, _filters(), atol=1e-7)
    assert cal.filters.dtype == np.float32 and cal.shape == SHAPE
    assert cal.model_id == MODEL and cal.format == "qfserve" and cal.path == path
    meta = cal.metadata
    assert meta["format_version"] == 2 and meta["post_rope"] is True
    np.testing.assert_array_equal(cal.query_scale, np.full((2, 2), 2.5, dtype=np.float32))
    assert (meta["n_sequences"], meta["tokens_per_sequence"], meta["samples_per_head"]) == (
        2,
        128,
        256,
    )
    assert meta["text"] == "unit test text" and meta["anisotropy"] == SUMMARY
    assert meta["created"].startswith("20")
    assert not list(tmp_path.glob("sub/.*tmp"))  # the atomic write left nothing behind


def test_save_normalises_and_validates(tmp_path):
    cal = read_calibration(_save(tmp_path / "a.safetensors", filters=3.0 * _filters()))
    np.testing.assert_allclose(np.linalg.norm(cal.filters, axis=-1), 1.0, atol=1e-6)
    bad = _filters()
    bad[1, 0, 3] = np.nan
    with pytest.raises(ValueError, match="non-finite"):
        _save(tmp_path / "b.safetensors", filters=bad)
    with pytest.raises(ValueError, match="model_id"):
        _save(tmp_path / "c.safetensors", model_id="")
    with pytest.raises(ValueError, match="shape"):
        _save(tmp_path / "d.safetensors", filters=np.ones((2, 32), np.float32))


def test_model_id_mismatch(tmp_path):
    path = _save(tmp_path / "a.safetensors")
    with pytest.raises(
        CalibrationError,
        match=rf"{_at(path)}.*calibrated for model '{MODEL}', "
        r"not 'other/model'",
    ):
        load_calibration(path, model_id="other/model")
    # An alias's base model id is accepted when the caller says so.
    assert load_calibration(path, model_id="other/4bit", accept_ids=[MODEL]).model_id == MODEL


@pytest.mark.parametrize(("field", "value"), [("n_layers", 3), ("n_kv_heads", 4), ("head_dim", 64)])
def test_shape_mismatch(tmp_path, field, value):
    path = _save(tmp_path / "a.safetensors")
    expected = {"n_layers": 2, "n_kv_heads": 2, "head_dim": 32, field: value}
    with pytest.raises(CalibrationError, match=rf"{_at(path)}.*{field}={value}"):
        load_calibration(path, model_id=MODEL, **expected)


def test_version_1_files_still_load_without_a_query_scale(tmp_path):
    path = tmp_path / "v1.safetensors"
    save_file({"filters": _filters()}, str(path), metadata=_raw_metadata(format_version="1"))
    cal = load_calibration(path, model_id=MODEL, n_layers=2, n_kv_heads=2, head_dim=32)
    assert cal.metadata["format_version"] == 1 and cal.query_scale is None
    np.testing.assert_allclose(cal.filters, _filters(), atol=1e-7)


@pytest.mark.parametrize(
    ("scale", "message"),
    [
        (None, "needs a 'query_scale' tensor"),
        (np.ones((3, 2), dtype=np.float32), r"query_scale must have shape \(2, 2\)"),
        (
            np.array([[1.0, np.nan], [1.0, 1.0]], dtype=np.float32),
            "query_scale contains non-finite",
        ),
    ],
)
def test_version_2_query_scale_is_validated(tmp_path, scale, message):
    path = tmp_path / "v2.safetensors"
    tensors = {"filters": _filters()} | ({} if scale is None else {"query_scale": scale})
    save_file(tensors, str(path), metadata=_raw_metadata(format_version="2"))
    with pytest.raises(CalibrationError, match=rf"{_at(path)}.*{message}"):
        read_calibration(path)


def test_saving_needs_a_query_scale(tmp_path):
    with pytest.raises(ValueError, match="query_scale is required"):
        _save(tmp_path / "a.safetensors", query_scale=None)


def test_version_mismatch(tmp_path):
    path = tmp_path / "v.safetensors"
    save_file({"filters": _filters()}, str(path), metadata=_raw_metadata(format_version="99"))
    with pytest.raises(CalibrationError, match=rf"{_at(path)}.*format_version is '99'"):
        load_calibration(path, model_id=MODEL)


def test_missing_metadata(tmp_path):
    path = tmp_path / "m.safetensors"
    meta = _raw_metadata()
    del meta["created"]
    save_file({"filters": _filters()}, str(path), metadata=meta)
    with pytest.raises(CalibrationError, match=rf"{_at(path)}.*missing \['created'\]"):
        read_calibration(path)


@pytest.mark.parametrize("keep", [0.5, 0.98, 0.0])
def test_truncated_file(tmp_path, keep):
    path = _save(tmp_path / "t.safetensors")
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CalibrationError, match=rf"{_at(path)}.*truncated or corrupt"):
        load_calibration(path, model_id=MODEL)


def test_garbage_file(tmp_path):
    path = tmp_path / "g.safetensors"
    path.write_bytes(b"\xff" * 64)
    with pytest.raises(CalibrationError, match=_at(path)):
        read_calibration(path)


def test_nan_file(tmp_path):
    path = tmp_path / "n.safetensors"
    bad = _filters()
    bad[0, 1, 0] = np.nan
    save_file({"filters": bad}, str(path), metadata=_raw_metadata())
    with pytest.raises(CalibrationError, match=rf"{_at(path)}.*non-finite"):
        load_calibration(path, model_id=MODEL)


def test_non_unit_rows_rejected(tmp_path):
    path = tmp_path / "u.safetensors"
    save_file({"filters": 2 * _filters()}, str(path), metadata=_raw_metadata())
    with pytest.raises(CalibrationError, match="unit length"):
        read_calibration(path)


def test_wrong_tensor_name(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"weights": _filters()}, str(path))
    with pytest.raises(CalibrationError, match=r"neither.*found \['weights'\]"):
        read_calibration(path)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        read_calibration(tmp_path / "nope.safetensors")


def test_authors_format_loads(tmp_path):
    """A file holding only ``q_filters`` (the authors' release). kvpress keeps keys with a
    high ``-(q_filters . k)``, so in our "high projection = keep" convention it is negated."""
    path = tmp_path / "authors.safetensors"
    raw = 2.0 * _filters(1)  # not necessarily unit length
    save_file({"q_filters": raw}, str(path))
    cal = load_calibration(path, model_id=MODEL, n_layers=2, n_kv_heads=2, head_dim=32)
    assert cal.format == "q_filters" and cal.model_id == MODEL
    assert cal.metadata["post_rope"] is None
    np.testing.assert_allclose(cal.filters, -_filters(1), atol=1e-6)
    # Same ranking of keys as the authors' scorer.
    keys = np.random.default_rng(0).standard_normal((10, 32)).astype(np.float32)
    np.testing.assert_array_equal(
        np.argsort(keys @ cal.filters[0, 0]), np.argsort(-(keys @ raw[0, 0]))
    )
    with pytest.raises(CalibrationError, match="n_layers=3"):
        load_calibration(path, model_id=MODEL, n_layers=3)


def test_authors_format_nan(tmp_path):
    path = tmp_path / "authors.safetensors"
    raw = _filters()
    raw[1, 1, 1] = np.inf
    save_file({"q_filters": raw}, str(path))
    with pytest.raises(CalibrationError, match=rf"{_at(path)}.*non-finite"):
        read_calibration(path)


def test_anisotropy_is_json_in_the_file(tmp_path):
    from safetensors import safe_open

    path = _save(tmp_path / "a.safetensors")
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
    assert json.loads(meta["anisotropy"]) == SUMMARY
    assert meta["post_rope"] == "true" and meta["format_version"] == "2"
