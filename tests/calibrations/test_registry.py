"""Registry: lookup by model id across the search path, aliases, and refusing bad files."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors.numpy import save_file

from qfserve.calibrations import registry
from qfserve.calibrations.artifact import (
    CalibrationError,
    load_calibration,
    read_calibration,
    save_calibration,
)
from qfserve.calibrations.registry import (
    CalibrationNotFoundError,
    aliases,
    artifact_name,
    available,
    find,
    load_for_model,
    model_id_for,
    search_path,
)

SHAPE = dict(n_layers=2, n_kv_heads=2, head_dim=8)


@pytest.fixture(autouse=True)
def hermetic(tmp_path, monkeypatch):
    """No user folder, env folders or shipped artifacts leak into these tests."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(registry.ENV_VAR, raising=False)
    monkeypatch.setattr(registry, "BUILTIN_DIR", tmp_path / "builtin")
    monkeypatch.setattr(registry, "ALIASES_FILE", tmp_path / "builtin-aliases.json")


def _write(folder, model_id, *, seed=0, stored_id=None, shape=(2, 2, 8)):
    f = np.random.default_rng(seed).standard_normal(shape).astype(np.float32)
    return save_calibration(
        folder / artifact_name(model_id),
        f,
        model_id=stored_id or model_id,
        n_sequences=1,
        tokens_per_sequence=16,
        samples_per_head=16,
        text="t",
        query_scale=np.ones(shape[:2], dtype=np.float32),
    )


def test_artifact_name():
    assert artifact_name("meta-llama/Llama-3.2-1B") == "meta-llama--Llama-3.2-1B.safetensors"
    assert artifact_name("a b:c") == "a_b_c.safetensors"
    with pytest.raises(ValueError, match="model_id"):
        artifact_name("")


def test_find_and_load(tmp_path):
    path = _write(tmp_path / "d", "org/model")
    assert find("org/model", search_dirs=[tmp_path / "d"]) == path
    cal = load_for_model("org/model", search_dirs=[tmp_path / "d"], **SHAPE)
    assert cal is not None and cal.model_id == "org/model" and cal.filters.shape == (2, 2, 8)


def test_miss_lists_what_exists(tmp_path):
    _write(tmp_path / "d", "org/one")
    _write(tmp_path / "d", "org/two")
    with pytest.raises(
        CalibrationNotFoundError,
        match=r"'org/three'.*Available: \['org/one', 'org/two'\].*calibrate",
    ):
        find("org/three", search_dirs=[tmp_path / "d"])
    assert load_for_model("org/three", search_dirs=[tmp_path / "d"], **SHAPE) is None


def test_alias_resolves_to_base_model(tmp_path):
    d = tmp_path / "d"
    base = _write(d, "org/base")
    (d / "aliases.json").write_text(json.dumps({"mlx-community/base-4bit": "org/base"}))
    assert find("mlx-community/base-4bit", search_dirs=[d]) == base
    cal = load_for_model("mlx-community/base-4bit", search_dirs=[d], **SHAPE)
    assert cal is not None and cal.model_id == "org/base"
    # An exact artifact beats the alias.
    own = _write(d, "mlx-community/base-4bit", seed=1)
    assert find("mlx-community/base-4bit", search_dirs=[d]) == own


def test_alias_miss_names_the_target(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "aliases.json").write_text(json.dumps({"q/4bit": "org/base"}))
    with pytest.raises(CalibrationNotFoundError, match=r"alias of 'org/base'.*org--base"):
        find("q/4bit", search_dirs=[d])


def test_alias_cycle_terminates(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "aliases.json").write_text(json.dumps({"a/a": "b/b", "b/b": "a/a"}))
    assert load_for_model("a/a", search_dirs=[d], **SHAPE) is None


def test_bad_alias_table_names_the_file(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    (d / "aliases.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="aliases.json"):
        aliases([d])


def test_search_order(tmp_path, monkeypatch):
    explicit, env, user = tmp_path / "explicit", tmp_path / "env", registry.user_dir()
    monkeypatch.setenv(registry.ENV_VAR, str(env))
    assert search_path([explicit])[:3] == [explicit, env, user]
    _write(user, "org/m", seed=0)
    assert find("org/m") == user / "org--m.safetensors"
    _write(env, "org/m", seed=1)
    assert find("org/m") == env / "org--m.safetensors"
    _write(explicit, "org/m", seed=2)
    assert find("org/m", search_dirs=[explicit]) == explicit / "org--m.safetensors"
    assert registry.default_output_dir() == env


def test_default_output_dir_is_user_dir_without_env():
    assert registry.default_output_dir() == registry.user_dir()
    assert registry.user_dir() in search_path()


def test_wrong_model_in_file_raises(tmp_path):
    # A file named for org/a that holds org/b's filters is never used for org/a.
    _write(tmp_path / "d", "org/a", stored_id="org/b")
    with pytest.raises(CalibrationError, match=r"org--a.safetensors.*'org/b', not 'org/a'"):
        load_for_model("org/a", search_dirs=[tmp_path / "d"], **SHAPE)


def test_shape_mismatch_raises(tmp_path):
    _write(tmp_path / "d", "org/a", shape=(3, 2, 8))
    with pytest.raises(CalibrationError, match=r"org--a.safetensors.*n_layers=2, got 3"):
        load_for_model("org/a", search_dirs=[tmp_path / "d"], **SHAPE)


def test_corrupt_file_raises_not_skipped(tmp_path):
    path = _write(tmp_path / "d", "org/a")
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(CalibrationError, match="org--a.safetensors"):
        load_for_model("org/a", search_dirs=[tmp_path / "d"], **SHAPE)


def test_authors_file_in_registry(tmp_path):
    d = tmp_path / "d"
    d.mkdir()
    raw = np.random.default_rng(0).standard_normal((2, 2, 8)).astype(np.float32)
    save_file({"q_filters": raw}, str(d / artifact_name("meta-llama/Llama-3.2-1B")))
    _write(d, "org/ours")
    assert available([d]) == ["meta-llama/Llama-3.2-1B", "org/ours"]
    cal = load_for_model("meta-llama/Llama-3.2-1B", search_dirs=[d], **SHAPE)
    assert cal is not None and cal.format == "q_filters"
    assert cal.model_id == "meta-llama/Llama-3.2-1B"


def test_model_id_for(tmp_path):
    assert (
        model_id_for("mlx-community/Llama-3.2-1B-Instruct-4bit")
        == "mlx-community/Llama-3.2-1B-Instruct-4bit"
    )
    named = tmp_path / "named"
    named.mkdir()
    (named / "config.json").write_text(json.dumps({"_name_or_path": "org/tiny"}))
    assert model_id_for(named) == "org/tiny"
    assert model_id_for(str(named) + "/") == "org/tiny"
    for path_like in ("/home/me/ckpt", "./out", "~/models/x", "a/b/c", ""):
        folder = tmp_path / f"f{abs(hash(path_like))}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"_name_or_path": path_like}))
        assert model_id_for(folder) == folder.name, path_like
    bare = tmp_path / "bare-model"
    bare.mkdir()
    assert model_id_for(bare) == "bare-model"
    snapshot = tmp_path / "hub" / "models--org--name" / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    assert model_id_for(snapshot) == "org/name"


def test_shipped_aliases_and_artifacts_are_valid(monkeypatch):
    """What ships in calibrations/ parses, and every shipped artifact is named for its model."""
    monkeypatch.undo()  # the real package folder
    table = aliases([])
    assert all("/" in k and "/" in v for k, v in table.items())
    for path in sorted(registry.BUILTIN_DIR.glob("*.safetensors")):
        cal = read_calibration(path)
        assert cal.model_id is None or artifact_name(cal.model_id) == path.name


def test_weights_fingerprint_is_checked_only_when_both_sides_have_one(tmp_path):
    f = np.random.default_rng(0).standard_normal((2, 2, 8)).astype(np.float32)
    args = dict(model_id="org/m", n_sequences=1, tokens_per_sequence=16, samples_per_head=16,
                query_scale=np.ones((2, 2), dtype=np.float32))  # fmt: skip
    with_fp = save_calibration(tmp_path / "a.safetensors", f, text="t", weights="00ff", **args)
    without = save_calibration(tmp_path / "b.safetensors", f, text="t", **args)
    assert read_calibration(with_fp).metadata["weights"] == "00ff"
    assert "weights" not in read_calibration(without).metadata
    load_calibration(with_fp, model_id="org/m", weights="00ff", **SHAPE)
    load_calibration(with_fp, model_id="org/m", **SHAPE)  # caller without a fingerprint
    load_calibration(without, model_id="org/m", weights="1234", **SHAPE)  # older artifact
    with pytest.raises(CalibrationError, match=r"a.safetensors.*other weights.*00ff.*1234"):
        load_calibration(with_fp, model_id="org/m", weights="1234", **SHAPE)
