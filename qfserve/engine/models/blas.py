"""Get a fast BLAS under MLX's Linux CPU backend, from PyPI alone where possible.

MLX's Linux CPU wheel links a reference BLAS; preloading OpenBLAS makes float32 matmul about
30x faster. MLX calls only ``cblas_sgemm``/``dgemm``/``cgemm`` and a few LAPACK routines from
it, so any library that exports those names can stand in. The loader honours ``LD_PRELOAD``
and ``LD_LIBRARY_PATH`` only at process start, so callers re-execute themselves once, before
MLX is imported.

Where the BLAS comes from (``QFSERVE_BLAS`` chooses; ``auto`` takes the first found):

1. ``pip``: the ``ngsolve-openblas`` wheel, a dependency on x86-64 Linux (OpenBLAS 0.3.33
   built for every x86-64 core, BSD). It needs ``libgfortran.so.5``; on a machine without one
   the copy the ``mlx-cpu`` wheel itself ships is named so in a private folder put on
   ``LD_LIBRARY_PATH`` (no root, nothing compiled). Other wheels were measured and rejected:
   ``scipy-openblas32`` prefixes every symbol, ``cmeel-openblas`` is built for AVX-512 only
   and crashes elsewhere, ``mkl`` is 323 MB (it is still used where installed, last).
2. ``system``: Debian's ``libopenblas0-pthread`` (or Fedora's path) where installed.
3. ``mkl``: ``libmkl_rt`` from the ``mkl`` wheel, where a user installed it.

``QFSERVE_BLAS`` may also be ``off`` (the reference BLAS; ``QFSERVE_NO_OPENBLAS=1`` too) or a
library's path.
"""

from __future__ import annotations

import ctypes
import importlib.metadata as md
import os
import sys
import tempfile
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

SYSTEM_OPENBLAS = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)
PIP_OPENBLAS = ("ngsolve-openblas", "libopenblas*.so*")  # (distribution, file name)
PIP_MKL = ("mkl", "libmkl_rt.so*")
# Wheels that ship an auditwheel-renamed libgfortran.so.5 (mlx-cpu always is installed here).
GFORTRAN_DONORS = ("mlx-cpu", "numpy", "scipy-openblas32", "scipy-openblas64")
SOURCES = ("auto", "pip", "system", "mkl", "off")
_MARKER = "QFSERVE_BLAS_REEXEC"


@dataclass(frozen=True)
class Blas:
    """A BLAS to preload: its file, where it came from, and folders its dependencies need
    on ``LD_LIBRARY_PATH``."""

    path: str
    origin: str  # "pip", "system", "mkl" or "env"
    lib_dirs: tuple[str, ...] = ()


def _wheel_file(dist: str, pattern: str) -> Path | None:
    """A file of an installed distribution whose name matches ``pattern``, found without
    importing it (``ngsolve_openblas`` loads its library on import)."""
    try:
        files = md.files(dist) or ()
    except md.PackageNotFoundError:
        return None
    hits = sorted(Path(str(f.locate())) for f in files if fnmatch(f.name, pattern))
    hits = [p for p in hits if p.is_file() and ".dist-info" not in str(p)]
    return hits[0].resolve() if hits else None


def _has_gfortran() -> bool:
    try:
        ctypes.CDLL("libgfortran.so.5")
    except OSError:
        return False
    return True


def _gfortran_folder() -> str | None:
    """A private folder where ``libgfortran.so.5`` names a wheel's own copy (with the
    libraries beside it that it needs, such as its ``libquadmath``)."""
    donor = next((p for d in GFORTRAN_DONORS if (p := _wheel_file(d, "libgfortran*.so.5*"))), None)
    if donor is None:
        return None
    links = {"libgfortran.so.5": donor}
    for sibling in donor.parent.glob("lib*.so*"):
        links.setdefault(sibling.name, sibling)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "qfserve" / "blas"
    for folder in (cache, None):
        try:
            where = Path(tempfile.mkdtemp(prefix="qfserve-blas-")) if folder is None else folder
            where.mkdir(parents=True, exist_ok=True)
            for name, target in links.items():
                link = where / name
                if link.is_symlink() and os.readlink(link) == str(target):
                    continue
                staged = where / f".{name}.{os.getpid()}"  # replaced atomically: starts race
                staged.unlink(missing_ok=True)
                staged.symlink_to(target)
                os.replace(staged, link)
            return str(where)
        except OSError:
            continue
    return None


def _pip() -> Blas | None:
    lib = _wheel_file(*PIP_OPENBLAS)
    if lib is None:
        return None
    if _has_gfortran():
        return Blas(str(lib), "pip")
    folder = _gfortran_folder()
    return None if folder is None else Blas(str(lib), "pip", (folder,))


def _system() -> Blas | None:
    found = next((c for c in SYSTEM_OPENBLAS if Path(c).exists()), None)
    return None if found is None else Blas(found, "system")


def _mkl() -> Blas | None:
    lib = _wheel_file(*PIP_MKL)
    return None if lib is None else Blas(str(lib), "mkl")


def find_blas(source: str | None = None) -> Blas | None:
    """The BLAS to preload (``source``: default ``$QFSERVE_BLAS``, else ``auto``), or ``None``
    off Linux, when turned off, or when none is found."""
    if not sys.platform.startswith("linux"):
        return None
    source = source or os.environ.get("QFSERVE_BLAS") or "auto"
    if source == "off" or os.environ.get("QFSERVE_NO_OPENBLAS") == "1":
        return None
    if source not in SOURCES:
        return Blas(source, "env") if Path(source).is_file() else None
    finders = {"pip": _pip, "system": _system, "mkl": _mkl}
    for name in finders if source == "auto" else (source,):
        found = finders[name]()
        if found is not None:
            return found
    return None


def find_openblas() -> str | None:
    """The path :func:`find_blas` chooses (servers started by tests preload it too)."""
    blas = find_blas()
    return None if blas is None else blas.path


def blas_active(blas: Blas | None = None) -> bool:
    """The chosen BLAS is mapped into this process (read from ``/proc/self/maps``: the
    preload may be a symlink)."""
    blas = blas or find_blas()
    if blas is None:
        return False
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return blas.path in os.environ.get("LD_PRELOAD", "")
    return blas.path in maps or os.path.realpath(blas.path) in maps


def wants_reexec() -> bool:
    """True when :func:`reexec_with_openblas` would re-execute this process: a BLAS was
    found and is not loaded yet, and no attempt was made before (an env marker)."""
    if os.environ.get(_MARKER):
        return False
    blas = find_blas()
    return blas is not None and not blas_active(blas)


# OpenBLAS's threads spin about 2^28 cycles after each product before they sleep, taking the
# cores from the native kernels' pool that runs right after (a prompt's attention between
# its layers' products: 1.3-1.5 s of a 2,048-token prefill's kernel time, 0.99 s with 2^4).
OPENBLAS_THREAD_TIMEOUT = "4"


def preload_env(blas: Blas, env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``blas`` preloaded (and its folders on ``LD_LIBRARY_PATH``); an OpenBLAS's
    threads sleep as soon as a product ends, unless ``OPENBLAS_THREAD_TIMEOUT`` says else."""
    out = dict(env)
    if blas.origin != "mkl":
        out.setdefault("OPENBLAS_THREAD_TIMEOUT", OPENBLAS_THREAD_TIMEOUT)
    preloaded = out.get("LD_PRELOAD", "")
    if blas.path not in preloaded:
        # A sanitizer's runtime must stay first in the list (it refuses to run otherwise).
        first = "libasan" in preloaded.split(":")[0]
        order = (preloaded, blas.path) if first else (blas.path, preloaded)
        out["LD_PRELOAD"] = ":".join(p for p in order if p)
    for folder in blas.lib_dirs:
        if folder not in out.get("LD_LIBRARY_PATH", "").split(":"):
            out["LD_LIBRARY_PATH"] = ":".join(
                p for p in (folder, out.get("LD_LIBRARY_PATH", "")) if p
            )
    return out


def reexec_with_openblas() -> None:
    """Re-execute this process with the BLAS preloaded, when that helps and is possible."""
    blas = find_blas()
    if blas is None or not wants_reexec():
        return
    env = preload_env(blas, dict(os.environ))
    env[_MARKER] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def blas_summary() -> str:
    """One line for start-up logs saying which BLAS MLX's CPU backend uses."""
    if sys.platform == "darwin":
        return "BLAS: Accelerate (macOS)"
    blas = find_blas()
    if blas is None:
        return (
            "BLAS: MLX reference BLAS (slow float32 matmul); on x86-64 `pip install "
            "ngsolve-openblas`, elsewhere `apt-get install libopenblas0-pthread`, ~30x faster"
        )
    if blas_active(blas):
        return f"BLAS: OpenBLAS from {blas.origin} preloaded ({blas.path})"
    return f"BLAS: MLX reference BLAS ({blas.origin} {blas.path} found but not preloaded)"
