"""End to end: `qfserve calibrate` on a tiny saved model, then the engine finds and uses it."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from safetensors import safe_open

from qfserve.calibrations import registry
from qfserve.calibrations.artifact import read_calibration
from qfserve.calibrations.cli import main
from qfserve.calibrations.model_info import attention_shape, weights_fingerprint
from qfserve.engine.filters.artifact import resolve_filters
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.kv.stats import summarize
from tests.tiny import save_tiny_model

MODEL_ID = "test/tiny-llama"


@pytest.fixture(autouse=True)
def hermetic(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(registry.ENV_VAR, raising=False)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "tiny-llama", model_id=MODEL_ID)


@pytest.fixture(scope="module")
def calibrated(model_dir, tmp_path_factory):
    """Run the command once for the module: (artifact folder, exit code, printed output)."""
    out = tmp_path_factory.mktemp("artifacts")
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(
            ["--model", str(model_dir), "--sequences", "2", "--tokens", "128", "--out", str(out)]
        )
    return out, rc, buf.getvalue()


def _run(model, caches, n=48):
    tokens = mx.array(np.arange(n, dtype=np.int32) % 300)[None]
    mx.eval(model(tokens, cache=caches))


def test_calibrate_writes_a_registered_artifact(calibrated):
    out, rc, printed = calibrated
    assert rc == 0
    path = out / "test--tiny-llama.safetensors"
    assert path.is_file()
    assert "positive_share" in printed and str(path) in printed
    cal = read_calibration(path)
    assert cal.model_id == MODEL_ID and cal.filters.shape == (2, 2, 32)
    meta = cal.metadata
    assert (meta["n_sequences"], meta["tokens_per_sequence"]) == (2, 128)
    assert meta["samples_per_head"] == 256 and meta["post_rope"] is True
    assert "standard library" in meta["text"]
    assert [s["layer"] for s in meta["anisotropy"]] == [0, 1]
    assert meta["format_version"] == 2 and cal.query_scale is not None
    assert cal.query_scale.shape == (2, 2) and np.isfinite(cal.query_scale).all()
    assert registry.find(MODEL_ID, search_dirs=[out]) == path
    assert MODEL_ID in registry.available([out])


def test_engine_uses_the_calibration(calibrated, model_dir, monkeypatch):
    out, _, _ = calibrated
    monkeypatch.setenv(registry.ENV_VAR, str(out))
    model, _ = mlx_lm.load(str(model_dir))
    # The local folder maps to the id in its config.json.
    for ref in (MODEL_ID, str(model_dir)):
        filters, source = resolve_filters(model, ref)
        assert source == "calibrated" and filters.shape == (2, 2, 32)
        assert filters.dtype == mx.float32
    caches = make_caches(model, CacheConfig(budget=16), filters=filters)
    _run(model, caches)
    assert summarize(caches).filter_source == "calibrated"


def test_model_without_artifact_falls_back(calibrated, model_dir, monkeypatch):
    out, _, _ = calibrated
    monkeypatch.setenv(registry.ENV_VAR, str(out))
    model, _ = mlx_lm.load(str(model_dir))
    filters, source = resolve_filters(model, "test/never-calibrated")
    assert filters is None and source == "fallback"
    caches = make_caches(model, CacheConfig(budget=16), filters=filters)
    _run(model, caches)
    assert summarize(caches).filter_source == "fallback"


def test_uncalibrated_model_without_standard_attention_falls_back():
    import mlx.nn as nn

    class NoAttention(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = [nn.Linear(4, 4)]

    assert resolve_filters(NoAttention(), "test/recurrent-thing") == (None, "fallback")


def test_engine_refuses_a_wrong_shape_artifact(calibrated, monkeypatch, tmp_path):
    """An artifact registered under the model's id but made for a different shape raises."""
    out, _, _ = calibrated
    monkeypatch.setenv(registry.ENV_VAR, str(out))
    from tests.tiny import make_tiny_model

    bigger = make_tiny_model(seed=0, num_hidden_layers=3)
    assert attention_shape(bigger) == (3, 2, 32)
    with pytest.raises(ValueError, match="test--tiny-llama.safetensors.*n_layers=3"):
        resolve_filters(bigger, MODEL_ID)


def test_artifact_records_the_weights_and_refuses_other_weights(calibrated, model_dir, monkeypatch):
    """Retrained weights under the same id are refused; an alias (a variant) is not checked."""
    out, _, _ = calibrated
    monkeypatch.setenv(registry.ENV_VAR, str(out))
    model, _ = mlx_lm.load(str(model_dir))
    recorded = read_calibration(out / "test--tiny-llama.safetensors").metadata["weights"]
    assert recorded == weights_fingerprint(model) and len(recorded) == 16
    # Same shapes and id, other values: what a retrained checkpoint of the model looks like.
    attn = model.model.layers[-1].self_attn
    attn.k_proj.weight = attn.k_proj.weight * 1.01
    assert weights_fingerprint(model) != recorded
    with pytest.raises(ValueError, match=r"test--tiny-llama.safetensors.*other weights"):
        resolve_filters(model, MODEL_ID)
    (out / "aliases.json").write_text(json.dumps({"test/tiny-llama-variant": MODEL_ID}))
    try:
        assert resolve_filters(model, "test/tiny-llama-variant")[1] == "calibrated"
    finally:
        (out / "aliases.json").unlink()


def test_text_files_and_context_clamp(tmp_path, capsys):
    model_dir = save_tiny_model(
        tmp_path / "short", model_id="test/short-context", max_position_embeddings=64
    )
    text = tmp_path / "corpus.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 200)
    out = tmp_path / "out"
    rc = main(
        [
            "--model",
            str(model_dir),
            "--text",
            str(text),
            "--sequences",
            "3",
            "--tokens",
            "500",
            "--samples-per-head",
            "40",
            "--chunk-size",
            "16",
            "--out",
            str(out),
            "--seed",
            "1",
        ]
    )
    assert rc == 0
    assert "using 64" in capsys.readouterr().out
    path = out / "test--short-context.safetensors"
    with safe_open(str(path), framework="numpy") as f:
        meta = f.metadata()
    assert meta["tokens_per_sequence"] == "64" and meta["samples_per_head"] == "40"
    assert "corpus.txt" in meta["text"]
    assert len(json.loads(meta["anisotropy"])) == 2


def test_model_id_override_and_errors(tmp_path, model_dir, capsys):
    out = tmp_path / "out"
    rc = main(
        [
            "--model",
            str(model_dir),
            "--model-id",
            "me/renamed",
            "--sequences",
            "1",
            "--tokens",
            "32",
            "--out",
            str(out),
        ]
    )
    assert rc == 0 and (out / "me--renamed.safetensors").is_file()
    assert main(["--model", str(model_dir), "--text", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt" in capsys.readouterr().err
    assert main(["--model", str(tmp_path / "not-a-model")]) == 1
    assert "cannot load model" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--model", str(model_dir), "--sequences", "0"])


def test_python_dash_m_entry_point():
    done = subprocess.run(
        [sys.executable, "-m", "qfserve.calibrations.cli", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and "--samples-per-head" in done.stdout


def test_one_long_text_file_gives_every_sequence_asked_for(tmp_path, model_dir, capsys):
    from qfserve.calibrations.artifact import read_calibration

    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "epsilon",
        "zeta",
        "eta",
        "theta",
        "iota",
        "kappa",
        "lambda",
        "mu",
    ]
    rng = np.random.default_rng(0)
    text = tmp_path / "big.txt"
    text.write_text(" ".join(rng.choice(words, 40_000)))
    assert len(text.read_text()) >= 200_000
    argv = ["--model", str(model_dir), "--text", str(text), "--out", str(tmp_path / "out")]
    assert main([*argv, "--sequences", "8", "--tokens", "512", "--samples-per-head", "64"]) == 0
    (artifact,) = (tmp_path / "out").glob("*.safetensors")
    meta = read_calibration(artifact).metadata
    assert meta["n_sequences"] == 8 and meta["tokens_per_sequence"] == 512
    assert "ran out" not in capsys.readouterr().out
    # Asking for more than the text holds says so.
    small = tmp_path / "small.txt"
    small.write_text(text.read_text()[:3000])
    argv = ["--model", str(model_dir), "--text", str(small), "--out", str(tmp_path / "out2")]
    assert main([*argv, "--sequences", "8", "--tokens", "512", "--samples-per-head", "64"]) == 0
    assert "note: the text ran out after" in capsys.readouterr().out
