"""Which GPU backend the fused kernels run on, chosen once, and the kernel objects, built lazily.

The backend is ``"metal"`` where ``mx.metal.is_available()``, ``"cuda"`` where MLX's CUDA
backend is, else ``None`` (the plain-MLX reference path runs). It is decided on first use and
cached. ``QFSERVE_KERNEL_BACKEND`` (``auto`` | ``none`` | ``metal`` | ``cuda``) pins it for a
process; :func:`use_backend` overrides it inside a ``with`` block, for tests.

Kernel objects are only constructed on first call: ``mx.fast.cuda_kernel`` raises on an MLX
build without CUDA, so nothing here may build one at import time.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache, lru_cache
from typing import Any, Literal, cast

import mlx.core as mx

from qfserve.kernels.sources import MAX_BUDGET, KernelSpec, render

Backend = Literal["metal", "cuda"]
KernelMode = Literal["auto", "on", "off"]
KERNEL_MODES: tuple[str, ...] = ("auto", "on", "off")
ENV_VAR = "QFSERVE_KERNEL_BACKEND"

_UNSET = object()
_override: ContextVar[Any] = ContextVar("qfserve_kernel_backend", default=_UNSET)


def detect_backend() -> Backend | None:
    """The GPU backend this MLX build can run custom kernels on, if any."""
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return None


@lru_cache(maxsize=1)
def _chosen() -> Backend | None:
    wanted = os.environ.get(ENV_VAR, "auto").strip().lower()
    if wanted == "auto":
        return detect_backend()
    if wanted == "none":
        return None
    if wanted in ("metal", "cuda"):
        found = detect_backend()
        if found != wanted:
            raise RuntimeError(f"{ENV_VAR}={wanted}, but this MLX build offers {found or 'no GPU'}")
        return wanted  # type: ignore[return-value]
    raise ValueError(f"{ENV_VAR} must be one of auto, none, metal, cuda, got {wanted!r}")


def active_backend() -> Backend | None:
    """The backend the fused kernels use: an active :func:`use_backend`, else the cached choice."""
    forced = _override.get()
    return _chosen() if forced is _UNSET else forced


@contextmanager
def use_backend(backend: Backend | None) -> Iterator[None]:
    """Pretend the backend is ``backend`` (``None``: no GPU) inside the block. For tests.

    Args:
        backend: ``"metal"``, ``"cuda"`` or ``None``. Nothing checks that it exists: a kernel
            called under a missing backend fails in MLX, which is what some tests want.
    """
    if backend not in (None, "metal", "cuda"):
        raise ValueError(f"backend must be 'metal', 'cuda' or None, got {backend!r}")
    token = _override.set(backend)
    try:
        yield
    finally:
        _override.reset(token)


def resolve_kernel_mode(mode: KernelMode, budget: int) -> bool:
    """Whether a cache with this setting and budget uses the fused kernel.

    Call once, when the cache is built, and keep the answer.

    Args:
        mode: ``"auto"``: the kernel where a backend exists and ``budget <= MAX_BUDGET``;
            ``"on"``: the kernel, or an error now; ``"off"``: never.
        budget: Rows kept per KV head, ``>= 1``.
    Returns:
        ``True`` to call the kernel on over-budget updates.
    Raises:
        ValueError: unknown ``mode``, ``budget < 1``, or ``mode="on"`` with
            ``budget > MAX_BUDGET``.
        RuntimeError: ``mode="on"`` and MLX has neither Metal nor CUDA here.
    """
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernel mode must be one of {KERNEL_MODES}, got {mode!r}")
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    if mode == "off":
        return False
    backend = active_backend()
    if mode == "auto":
        return backend is not None and budget <= MAX_BUDGET
    check_kernel_budget(budget)
    if backend is None:
        raise RuntimeError(
            "the fused eviction kernel was required (kernel='on' / use_kernel=True), but MLX "
            "here has neither a Metal nor a CUDA backend (or QFSERVE_KERNEL_BACKEND=none); "
            "use kernel='auto' or 'off'"
        )
    return True


def check_kernel_budget(budget: int) -> None:
    """Raise if ``budget`` does not fit the apply kernel's compile-time staging buffer."""
    if not 1 <= budget <= MAX_BUDGET:
        raise ValueError(
            f"budget must be in [1, {MAX_BUDGET}] for the fused eviction kernel, got {budget}; "
            "larger budgets run on the plain-MLX path (kernel='auto' or 'off')"
        )


@cache
def _build(spec: KernelSpec, backend: Backend) -> Callable[..., list[mx.array]]:
    header, source = render(spec, backend)
    make = mx.fast.metal_kernel if backend == "metal" else mx.fast.cuda_kernel
    built: object = make(
        name=spec.name,
        input_names=list(spec.input_names),
        output_names=list(spec.output_names),
        source=source,
        header=header,
    )
    # The stubs type the kernel object as `object`; it is called with inputs and returns outputs.
    return cast(Callable[..., list[mx.array]], built)


def kernel(spec: KernelSpec) -> Callable[..., list[mx.array]]:
    """The MLX kernel object for ``spec`` on the active backend, built on first use.

    Raises:
        RuntimeError: no backend is active.
    """
    backend = active_backend()
    if backend is None:
        raise RuntimeError(f"no Metal or CUDA backend for MLX here to run {spec.name}")
    return _build(spec, backend)
