"""The process's memory: what it holds resident, and giving freed memory back.

MLX keeps freed buffers for reuse (``mx.clear_cache`` hands them back), and glibc's malloc
keeps freed heap pages of its own: after a long prompt, hundreds of megabytes of activations
and caches that no request holds any more stay resident until ``malloc_trim`` returns them.
A server whose point is bounded memory gives them back when it goes idle.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from functools import cache
from pathlib import Path
from typing import Any


def resident_bytes() -> int:
    """The process's resident memory now (Linux ``/proc``; elsewhere its peak, from
    ``getrusage``), Python, MLX and the server included."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


@cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


def release_memory(*, after: Any = None) -> None:
    """Wait for the MLX work queued on the stream ``after`` (where given), then hand MLX's
    cached buffers back, then the C heap's free pages (glibc only)."""
    import mlx.core as mx

    if after is not None:
        mx.synchronize(after)
    mx.clear_cache()
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
