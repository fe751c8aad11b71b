"""Every registered study, run once per session with ``--quick`` on the bundled qfserve-tiny.

:func:`quick` runs a study the first time a test asks for it and hands back the JSON it wrote;
studies that need what this machine lacks skip, saying what (:func:`missing`). The quality
studies calibrate afresh into a temporary cache (never the user's), except those that read the
registry's filters as the server does.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.studies import STUDIES, study

# Arguments beyond --quick: retrieval and niah share one prefill, queries included, across
# every kind of arm; the kvpress reference needs its own Python.
EXTRA = {
    "retrieval": ["--self-calibrated", "--query-aware", "--kvzip"],
    "niah": ["--self-calibrated", "--query-aware", "--kvzip"],
}
REGISTRY_FILTERS = {
    "stability",
    "multiturn-recall",
    "kvzip-reuse",
    "niah-served",
    "long-context",
    "llama-parity",
}  # no --calibration
KVPRESS_PYTHON = os.environ.get("QFSERVE_KVPRESS_PYTHON", "")


def missing(name: str) -> str:
    """Why ``name`` cannot run here ('' when it can)."""
    if name == "kvzip-parity" and not (KVPRESS_PYTHON and Path(KVPRESS_PYTHON).exists()):
        return "needs a Python with torch, transformers and kvpress: set QFSERVE_KVPRESS_PYTHON"
    if name in ("vs-llama-cpp", "memory"):
        import subprocess

        from qfserve.testing import LLAMA_PYTHON, llama_tool

        if llama_tool("llama-server") is not None:
            return ""
        if name == "memory":
            return "needs llama.cpp's llama-server: bench/reference/llama_cpp_tools.sh builds it"
        found = subprocess.run([LLAMA_PYTHON, "-c", "import llama_cpp.server"],
                               capture_output=True).returncode == 0  # fmt: skip
        if not found:
            return (
                "needs llama.cpp's llama-server (bench/reference/llama_cpp_tools.sh) or "
                "llama-cpp-python[server] (a Python with it named by QFSERVE_LLAMA_PYTHON)"
            )
    if name == "blas":
        from bench.studies.blas import missing as blas_missing

        return blas_missing()
    if name == "llama-parity":
        from qfserve.testing import llama_cpp_python

        if llama_cpp_python() is None:
            return "needs llama-cpp-python (bench/reference/llama_cpp_tools.sh)"
    if name == "kernel-cuda":
        if importlib.util.find_spec("torch") is None or importlib.util.find_spec("cupy") is None:
            return "needs torch and cupy with an NVIDIA GPU"
        import torch

        if not torch.cuda.is_available():
            return "needs an NVIDIA GPU (torch sees none)"
    return ""


def argv_for(name: str, out: Path) -> list[str]:
    argv = ["--quick", "--out", str(out), *EXTRA.get(name, [])]
    s = study(name)
    if s.section == "quality" and name not in REGISTRY_FILTERS:
        argv += ["--calibration", "fresh"]
    if name == "kvzip-parity":
        argv += ["--kvpress-python", KVPRESS_PYTHON]
    if name == "vs-llama-cpp":  # llama.cpp reads GGUF: the default model's, short
        argv += ["--model", "smollm2-135m-instruct", "--prompts", "64", "--reps", "1"]
    if name == "memory":  # the default model's GGUF, a short context
        argv += ["--model", "smollm2-135m-instruct"]
    if name == "llama-parity":  # llama.cpp reads GGUF: the default model's
        argv += ["--model", "smollm2-135m-instruct"]
    return argv


@pytest.fixture(scope="session")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder every quick run writes to (its calibration cache beside it)."""
    out = tmp_path_factory.mktemp("results")
    from bench import arms

    arms.CACHE_DIR = out / "cache"
    return out


@pytest.fixture(scope="session")
def quick(results: Path) -> Callable[[str], dict[str, Any]]:
    """``quick(name)``: the JSON the study wrote on its quick run (run at the first ask)."""
    done: dict[str, dict[str, Any]] = {}

    def run(name: str) -> dict[str, Any]:
        if reason := missing(name):
            pytest.skip(reason)
        if name not in done:
            s = STUDIES[name]
            s.module().main(argv_for(name, results))
            done[name] = json.loads((results / f"{s.key}.json").read_text())
        return done[name]

    return run
