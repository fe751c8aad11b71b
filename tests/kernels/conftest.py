"""The native kernels, built once per machine for the kernel tests."""

from __future__ import annotations

import contextlib
import shutil
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest

from qfserve.kernels import native


def _buildable() -> str | None:
    if not sys.platform.startswith("linux"):
        return "the native kernel is built on Linux only"
    if shutil.which("cmake") is None or shutil.which("c++") is None:
        return "no cmake or C++ compiler on this machine"
    return None


@pytest.fixture(scope="module")
def kernel():
    """Built once per machine into qfserve's cache (as a server builds it): where a compiler
    and CMake exist, a failed build is a failure, not a skip."""
    from qfserve.engine.models.gguf.convert import cache_root

    if reason := _buildable():
        pytest.skip(reason)
    module = native.load(cache_root() / "native")
    assert module is not None, "the native kernel did not build (see the warning logged)"
    return module


@contextlib.contextmanager
def activations(kernel: ModuleType, bits: int) -> Iterator[None]:
    """Few-row products on x rounded to ``bits`` (0: float32; integers where the CPU has
    VNNI or AVX2), the process's setting restored after."""
    before = kernel.activation_bits()
    kernel.activation_bits(bits if kernel.integer_activations else 0)
    try:
        yield
    finally:
        kernel.activation_bits(before)
