"""qfserve's kernels: the eviction step fused for GPUs, and the native CPU kernels that
prefill, decode and KVzip's reconstruction pass run on.

* GPU (Metal, CUDA): the eviction step in two launches, :mod:`.qfilters_score` (Q-Filters
  scores) and :mod:`.qfilters_apply` (keep ``budget`` rows per group), each beside a plain-MLX
  reference that is also the CPU path; their source text, written once for both backends
  (:mod:`.sources`); the backend, chosen once (:mod:`.backend`); and a numpy model of the
  apply kernel, step by step (:mod:`.cpu_model`).
* CPU, in :mod:`.native` (MLX primitives in C++, built on the machine on first use): products
  on quantized weights' codes (decode rows, and a prompt's tiles into the BLAS), attention of
  a decode step and of a prompt block (with KVzip's reconstruction scores from the same
  logits), RoPE, RMS norm, SwiGLU, a decode step's transformer block in two ops and an
  eviction cache's decode step.

The GPU path's entry points (imported lazily, so :mod:`.sources` and :mod:`.cpu_model` load on
a machine without MLX):

* :func:`fused_evict` — keep ``budget`` rows per (b, h) group (dispatch 2, apply).
* :func:`qfilter_scores` — Q-Filters scores, protected rows +inf (dispatch 1, score).
* :func:`resolve_kernel_mode` — the cache's ``auto`` / ``on`` / ``off`` setting to a bool.
* :func:`active_backend`, :func:`use_backend` — the backend, chosen once; a test override.
* :data:`MAX_BUDGET` — the largest budget the kernel accepts.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "MAX_BUDGET": "qfserve.kernels.sources",
    "KERNEL_MODES": "qfserve.kernels.backend",
    "KernelMode": "qfserve.kernels.backend",
    "active_backend": "qfserve.kernels.backend",
    "detect_backend": "qfserve.kernels.backend",
    "resolve_kernel_mode": "qfserve.kernels.backend",
    "use_backend": "qfserve.kernels.backend",
    "fused_evict": "qfserve.kernels.qfilters_apply",
    "qfilter_scores": "qfserve.kernels.qfilters_score",
}

__all__ = [
    "KERNEL_MODES",
    "MAX_BUDGET",
    "KernelMode",
    "active_backend",
    "detect_backend",
    "fused_evict",
    "qfilter_scores",
    "resolve_kernel_mode",
    "use_backend",
]

if TYPE_CHECKING:
    from qfserve.kernels.backend import (
        KERNEL_MODES,
        KernelMode,
        active_backend,
        detect_backend,
        resolve_kernel_mode,
        use_backend,
    )
    from qfserve.kernels.qfilters_apply import fused_evict
    from qfserve.kernels.qfilters_score import qfilter_scores
    from qfserve.kernels.sources import MAX_BUDGET


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qfserve.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
