"""A fresh qfserve cache for a test that shares the one thing a fresh cache would rebuild."""

from __future__ import annotations

from pathlib import Path


def fresh_cache(folder: Path) -> Path:
    """``folder/qfserve``, a cache of its own (``folder`` as ``XDG_CACHE_HOME``) whose native
    kernels are the user's: a test about a fresh cache (downloads, conversions, calibrations)
    need not build them again, ~40 s on two cores. Returns ``folder``."""
    from qfserve.engine.models.gguf.convert import cache_root

    native = cache_root() / "native"
    native.mkdir(parents=True, exist_ok=True)  # the first server to need them builds them there
    (folder / "qfserve").mkdir(parents=True, exist_ok=True)
    link = folder / "qfserve" / "native"
    if not link.exists():
        link.symlink_to(native)
    return folder
