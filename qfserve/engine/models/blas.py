"""Get OpenBLAS under MLX's Linux CPU backend.

MLX's Linux CPU wheel links a reference BLAS; preloading OpenBLAS makes float32 matmul
about 30x faster. The loader only honours ``LD_PRELOAD`` at process start, so callers
re-execute themselves once, before MLX is imported.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)
_MARKER = "QFSERVE_BLAS_REEXEC"


def find_openblas() -> str | None:
    """Return the path of an installed OpenBLAS shared library, or None."""
    if not sys.platform.startswith("linux"):
        return None
    for candidate in OPENBLAS_CANDIDATES:
        if Path(candidate).exists():
            return candidate
    return None


def openblas_active() -> bool:
    """True when OpenBLAS is preloaded into this process."""
    lib = find_openblas()
    return lib is not None and lib in os.environ.get("LD_PRELOAD", "")


def wants_reexec() -> bool:
    """True when :func:`reexec_with_openblas` would re-execute this process.

    False off Linux, when OpenBLAS is missing, when it is already preloaded, when
    ``QFSERVE_NO_OPENBLAS=1`` is set, or after one attempt (guarded by an env marker).
    """
    if find_openblas() is None or openblas_active() or os.environ.get(_MARKER):
        return False
    return os.environ.get("QFSERVE_NO_OPENBLAS") != "1"


def reexec_with_openblas() -> None:
    """Re-execute this process with OpenBLAS preloaded, when that helps and is possible."""
    lib = find_openblas()
    if lib is None or not wants_reexec():
        return
    env = dict(os.environ)
    env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env[_MARKER] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


def blas_summary() -> str:
    """One line for start-up logs saying which BLAS MLX's CPU backend uses."""
    if sys.platform == "darwin":
        return "BLAS: Accelerate (macOS)"
    lib = find_openblas()
    if openblas_active():
        return f"BLAS: OpenBLAS preloaded ({lib})"
    if lib is None:
        return (
            "BLAS: MLX reference BLAS (slow float32 matmul); "
            "install libopenblas0-pthread for ~30x faster CPU matmul"
        )
    return "BLAS: MLX reference BLAS (OpenBLAS present but not preloaded)"
