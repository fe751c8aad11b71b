"""qfserve's native CPU kernels: a matrix product on weights that stay quantized, attention
of one query a head (decode steps), causal attention of a prompt block (which can also give
KVzip's reconstruction scores), RoPE, RMS norm, SwiGLU and an eviction cache's decode step.

MLX's CPU backend has no user kernels from Python (``mx.fast.metal_kernel`` is Metal only).
Its own CPU ``quantized_matmul`` is slower than a float32 product on the same weights, so a
decode step on the CPU read the dequantized float32 weights: ~540 MB a step for
SmolLM2-135M; ``quantized_matmul.cpp`` reads the weights' 4- to 8-bit codes instead (about
5x fewer bytes), and for a prompt dequantizes a tile of them at a time for the BLAS, so no
float32 copy of the weights is held. Its CPU attention repeats a grouped layer's keys to every query head
on each call; ``decode_attention.cpp`` reads them once. A prompt block's attention in numpy
tiles ran on one thread; ``prefill_attention.cpp`` walks the keys in blocks with an online
softmax on every core. MLX's CPU runs RoPE, RMS norm and SwiGLU as several small ops each
and an eviction step as a dozen; ``rope.cpp``, ``pointwise.cpp`` and ``evict_step.cpp`` are
one op each. Every op costs dispatch, so a decode step's transformer block is two ops around
its cache and attention (``decode_block.cpp``, the same routines in one dispatch each). All are MLX primitives with a CPU implementation (``kernels.h``),
sharing one pool of threads (``pool.h``); see each source's header for its arithmetic.

It is built on this machine, on first use, with CMake against the installed MLX and nanobind
(``-march=native``: the user's own CPU, and MLX's own C++ ABI), into
``<cache>/native/<key>``, where the key names the sources, MLX, nanobind, Python and the
machine, so an upgrade of any of them builds again. Where it cannot be built (no compiler,
no CMake, no nanobind, a platform other than Linux) or fails its check against numpy,
:func:`load` says why once and returns ``None``, and callers keep the float32 path.
``QFSERVE_NATIVE=off`` turns it off; ``QFSERVE_NATIVE_THREADS`` sets the pool's threads
(default: the machine's cores). ``QFSERVE_NATIVE_SANITIZE=1`` builds (and keys) a separate
module under AddressSanitizer and UndefinedBehaviorSanitizer, for the kernel tests and a
served session run by ``tests/kernels/sanitized.sh`` (Python must then preload libasan).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.metadata as md
import importlib.util
import logging
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from types import ModuleType

logger = logging.getLogger(__name__)

SOURCES = (
    "CMakeLists.txt",
    "kernels.h",
    "pool.h",
    "module.cpp",
    "quantized_matmul.cpp",
    "decode_attention.cpp",
    "prefill_attention.cpp",
    "rope.cpp",
    "pointwise.cpp",
    "evict_step.cpp",
    "decode_block.cpp",
    "detail.h",
    "simd.h",
    "rows.h",
)
MODULE = "_native"
# What a decode step's rows of activations are rounded to before products on codes
# (``activation_bits``; AVX-512 VNNI or AVX2): --decode-activations' choices, and their bits.
ACTIVATIONS = {"int32": 32, "int16": 16, "int8": 8, "float32": 0}
DEFAULT_ACTIVATIONS = "int32"
_BUILD_TIMEOUT_S = 600
_lock = threading.Lock()


class NativeUnavailable(RuntimeError):
    """The kernel cannot be built or loaded here (the message says why)."""


def enabled() -> bool:
    """``QFSERVE_NATIVE`` is not ``off`` (nor ``0``), and this is Linux, where MLX runs on
    the CPU (macOS has Metal, whose quantized kernels are MLX's own)."""
    setting = os.environ.get("QFSERVE_NATIVE", "auto").strip().lower()
    return setting not in ("off", "0", "false", "no") and sys.platform.startswith("linux")


@cache
def load(cache_dir: Path) -> ModuleType | None:
    """The built kernel module, building it under ``cache_dir`` on first use; ``None``
    (logged once, with the reason) where it is off or cannot be built here. Remembered per
    folder for the life of the process, a failure included."""
    if not enabled():
        return None
    try:
        return _load(cache_dir)
    except NativeUnavailable as exc:
        logger.warning("native kernels unavailable (decode reads float32 weights): %s", exc)
        return None


def build_key() -> str:
    """What the built file depends on: the sources, MLX, nanobind, Python and the machine."""
    digest = hashlib.sha256()
    for name in SOURCES:
        digest.update((Path(__file__).parent / name).read_bytes())
    for dist in ("mlx", "nanobind"):
        digest.update(_version(dist).encode())
    digest.update(f"{sys.version_info[:2]} {platform.machine()} {_cpu_flags()}".encode())
    return digest.hexdigest()[:16] + ("-sanitized" if sanitized() else "")


def sanitized() -> bool:
    """``QFSERVE_NATIVE_SANITIZE`` asks for the ASan + UBSan build."""
    return os.environ.get("QFSERVE_NATIVE_SANITIZE", "").strip().lower() in ("1", "on", "true")


def _load(cache_dir: Path) -> ModuleType:
    with _lock:
        folder = cache_dir / build_key()
        built = _built_file(folder)
        if built is None:
            with _file_lock(cache_dir):
                built = _built_file(folder) or _build(folder)
        module = _import(built)
        _check(module)
        logger.info(
            "native kernels: %s, %s, %d threads%s",
            built,
            module.simd,
            module.threads(),
            ", integer activations" if module.integer_activations else "",
        )
        return module


def _built_file(folder: Path) -> Path | None:
    found = sorted(folder.glob(f"{MODULE}*.so")) if folder.is_dir() else []
    return found[0] if found else None


def _build(folder: Path) -> Path:
    """Configure and build into a temporary folder, then move the module into ``folder``."""
    cmake = shutil.which("cmake") or _pip_cmake()
    if cmake is None:
        raise NativeUnavailable("no cmake (install the cmake package from PyPI)")
    if shutil.which("c++") is None and shutil.which("g++") is None:
        raise NativeUnavailable("no C++ compiler (c++ or g++) on PATH")
    try:
        import nanobind
    except ImportError as exc:
        raise NativeUnavailable("nanobind is not installed") from exc
    import mlx.core

    logger.info("building the native kernels (once, ~30-60 s) into %s", folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=folder.parent) as tmp:
        configure = [
            cmake,
            "-S",
            str(Path(__file__).parent),
            "-B",
            tmp,
            "-DCMAKE_BUILD_TYPE=Release",
            f"-DPython_EXECUTABLE={sys.executable}",
            f"-Dnanobind_ROOT={nanobind.cmake_dir()}",
            # The folder of the loaded MLX (mlx is a namespace package: a folder named mlx on
            # sys.path would join its __path__).
            f"-DMLX_ROOT={Path(mlx.core.__file__).parent}",
            f"-DQFSERVE_SANITIZE={'ON' if sanitized() else 'OFF'}",
        ]
        for step in (configure, [cmake, "--build", tmp, "-j", str(os.cpu_count() or 1)]):
            try:
                done = subprocess.run(
                    step, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S, check=False
                )
            except (OSError, subprocess.TimeoutExpired) as exc:
                raise NativeUnavailable(f"building failed: {exc}") from exc
            if done.returncode != 0:
                tail = (done.stdout + done.stderr).strip().splitlines()[-12:]
                raise NativeUnavailable(f"{shlex.join(step)} failed:\n" + "\n".join(tail))
        built = _built_file(Path(tmp))
        if built is None:
            raise NativeUnavailable(f"the build made no {MODULE} module")
        staged = Path(tempfile.mkdtemp(prefix=".staged-", dir=folder.parent))
        shutil.copy2(built, staged / built.name)
        if folder.exists():  # a damaged earlier build
            shutil.rmtree(folder)
        staged.rename(folder)
    return folder / built.name


def _import(path: Path) -> ModuleType:
    name = f"{__name__}.{MODULE}"
    if name in sys.modules:
        return sys.modules[name]
    loader = importlib.machinery.ExtensionFileLoader(name, str(path))
    spec = importlib.util.spec_from_file_location(name, path, loader=loader)
    if spec is None:
        raise NativeUnavailable(f"cannot import {path}")
    try:
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except ImportError as exc:
        raise NativeUnavailable(f"cannot import {path}: {exc}") from exc
    sys.modules[name] = module
    return module


def _check(module: ModuleType) -> None:
    """The kernel against numpy on small products at every bit width, few rows and many (a
    nanobind whose ABI differs from MLX's own would fail here, not in the first request)."""
    import mlx.core as mx
    import numpy as np

    rng = np.random.default_rng(0)
    for bits in (4, 5, 6, 8):
        weights = mx.array(rng.standard_normal((96, 64), dtype=np.float32))
        w, scales, biases = mx.quantize(weights, group_size=32, bits=bits)
        scales, biases = scales.astype(mx.float32), biases.astype(mx.float32)
        dense = np.asarray(mx.dequantize(w, scales, biases, group_size=32, bits=bits))
        for rows, rounded in ((3, 0), (3, 8), (1, 16), (1, 32), (40, 0)):
            x = mx.array(rng.standard_normal((rows, 64), dtype=np.float32))
            # Integer activations round x: each element by up to its block's max / 254.
            slack = np.abs(dense).sum(axis=1) * np.abs(np.asarray(x)).max() / 127 if rounded else 0
            try:
                module.activation_bits(rounded if module.integer_activations else 0)
                got = np.asarray(module.quantized_matmul(x, w, scales, biases, bits))
            except (TypeError, RuntimeError, ValueError) as exc:
                raise NativeUnavailable(f"the built kernel does not run: {exc}") from exc
            finally:
                default = ACTIVATIONS[DEFAULT_ACTIVATIONS]
                module.activation_bits(default if module.integer_activations else 0)
            want = np.asarray(x) @ dense.T
            if not np.all(np.abs(got - want) <= 1e-4 + 1e-4 * np.abs(want) + slack):
                raise NativeUnavailable(
                    f"the built kernel disagrees with numpy at {bits} bits, {rows} rows"
                    + (f" ({rounded}-bit activations)" if rounded else "")
                )


def _pip_cmake() -> str | None:
    """The ``cmake`` binary of the PyPI package, where installed."""
    try:
        from cmake import CMAKE_BIN_DIR  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return None
    path = Path(CMAKE_BIN_DIR) / "cmake"
    return str(path) if path.exists() else None


def _version(dist: str) -> str:
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return "-"


def _cpu_flags() -> str:
    """The CPU's feature flags (the build is ``-march=native``); empty off Linux."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@contextlib.contextmanager
def _file_lock(folder: Path) -> Iterator[None]:
    """One build at a time across processes (servers and test workers start together)."""
    folder.mkdir(parents=True, exist_ok=True)
    import fcntl

    with (folder / ".lock").open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
