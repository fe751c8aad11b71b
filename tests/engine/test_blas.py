"""The fast BLAS comes from PyPI alone: on a machine where the system's OpenBLAS and
libgfortran cannot be loaded, the re-executed process maps the wheel's OpenBLAS and MLX's
float32 matmul is many times faster than on its reference BLAS, and exact."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qfserve.engine.models import blas

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")

# Re-executes itself with the chosen BLAS, then reports what is mapped and how fast it is.
PROBE = """
import json, time, numpy as np
from qfserve.engine.models.blas import reexec_with_openblas
reexec_with_openblas()
import mlx.core as mx
a = mx.random.normal((256, 576)); b = mx.random.normal((576, 1536)); mx.eval(a, b)
best = 1e9
for _ in range(10):
    t = time.perf_counter(); mx.eval(a @ b); best = min(best, time.perf_counter() - t)
err = float(np.abs(np.array(a @ b) - np.array(a).astype(np.float64) @ np.array(b)).max())
maps = open("/proc/self/maps").read()
libs = sorted({line.split()[-1] for line in maps.splitlines() if "blas" in line or "gfortran" in line})
print(json.dumps({"seconds": best, "err": err, "libs": libs}))
"""


def probe(env: dict[str, str], hide: list[str] = ()) -> dict:
    command = [sys.executable, "-c", PROBE]
    if hide:  # a private mount namespace where these files read as empty: unloadable
        binds = "; ".join(f"mount --bind /dev/null {f} || exit 99" for f in hide)
        command = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                   f'{binds}; exec "$@"', "hide", *command]  # fmt: skip
    out = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    if out.returncode == 99:
        pytest.skip("cannot hide system libraries here (needs root and unshare)")
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def system_libraries() -> list[str]:
    """The system's OpenBLAS and libgfortran files (their real paths)."""
    names = ("libopenblas", "libgfortran.so.5", "libblas.so.3", "liblapack.so.3")
    found = set()
    for folder in ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64"):
        for path in Path(folder).rglob("lib*.so*") if Path(folder).is_dir() else ():
            if any(path.name.startswith(n) for n in names) and path.exists():
                found.add(str(path.resolve()))
    return sorted(found)


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "LD_LIBRARY_PATH", "QFSERVE_BLAS_REEXEC")}  # fmt: skip
    return {**env, "XDG_CACHE_HOME": extra.pop("cache", env.get("XDG_CACHE_HOME", "")), **extra}


def test_the_order_and_the_overrides(monkeypatch, tmp_path):
    monkeypatch.delenv("QFSERVE_BLAS", raising=False)
    monkeypatch.delenv("QFSERVE_NO_OPENBLAS", raising=False)
    pip = blas.find_blas("pip")
    if pip is None:
        pytest.skip("ngsolve-openblas is not installed (x86-64 Linux only)")
    assert blas.find_blas() == pip and pip.origin == "pip"  # the wheel first
    assert "libopenblas" in Path(pip.path).name
    monkeypatch.setenv("QFSERVE_BLAS", "off")
    assert blas.find_blas() is None and not blas.wants_reexec()
    lib = tmp_path / "libmine.so"
    lib.write_bytes(b"")
    monkeypatch.setenv("QFSERVE_BLAS", str(lib))
    assert blas.find_blas() == blas.Blas(str(lib), "env")
    env = blas.preload_env(blas.Blas("/x/lib.so", "pip", ("/d",)), {"LD_LIBRARY_PATH": "/e"})
    assert env["LD_PRELOAD"] == "/x/lib.so" and env["LD_LIBRARY_PATH"] == "/d:/e"
    # OpenBLAS's threads sleep after a product (the native kernels' pool runs next) unless
    # the user set their own timeout; MKL's are left alone.
    assert env["OPENBLAS_THREAD_TIMEOUT"] == "4"
    mine = blas.preload_env(blas.Blas("/x/lib.so", "pip"), {"OPENBLAS_THREAD_TIMEOUT": "20"})
    assert mine["OPENBLAS_THREAD_TIMEOUT"] == "20"
    assert "OPENBLAS_THREAD_TIMEOUT" not in blas.preload_env(blas.Blas("/m.so", "mkl"), {})


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare")
def test_the_wheels_openblas_runs_where_the_system_has_none(tmp_path):
    if blas.find_blas("pip") is None:
        pytest.skip("ngsolve-openblas is not installed (x86-64 Linux only)")
    hidden = system_libraries()
    # One thread each: the reference BLAS has one, and a second OpenBLAS thread on a busy
    # machine waits for a core, which measured the pool rather than the library.
    one = {"OPENBLAS_NUM_THREADS": "1", "cache": str(tmp_path)}
    fast = probe(clean_env(QFSERVE_BLAS="pip", **one), hidden)
    slow = probe(clean_env(QFSERVE_BLAS="off", **one), hidden)
    wheel = [lib for lib in fast["libs"] if "ngsolve_openblas" in lib]
    assert wheel, fast["libs"]
    assert not [lib for lib in fast["libs"] if lib in hidden], fast["libs"]
    if not Path("/usr/lib/x86_64-linux-gnu/libgfortran.so.5").exists() or hidden:
        # libgfortran came from the mlx-cpu wheel, named in the private folder
        assert any("mlx_cpu.libs" in lib and "gfortran" in lib for lib in fast["libs"])
    assert fast["err"] < 1e-3 and slow["err"] < 1e-3
    # ~15x on one thread on a quiet machine; 3x leaves room for a busy one
    assert slow["seconds"] > 3 * fast["seconds"], (slow, fast)
