"""Every mode of every registered study, run once per session with ``--quick`` on the bundled
qfserve-tiny.

:func:`quick` runs a mode the first time a test asks for the JSON file it writes and hands that
JSON back; modes that need what this machine lacks skip, saying what (:func:`missing`). The
quality studies calibrate afresh into a temporary cache (never the user's), except those that
read the registry's filters as the server does.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from bench.studies import STUDIES, owner

# Every JSON file a study's mode writes: (study, file), in the registry's order.
CASES = [(s.name, f) for s in STUDIES.values() for f in s.files]
# Arguments beyond --quick, by file: retrieval shares one prefill, queries and hidden states
# included, across every kind of arm, in either haystack; kvzap's surrogates are trained in
# seconds (a linear one from two 64-token texts) where the registry has none.
EXTRA = {
    "retrieval": ["--query-aware", "--kvzip", "--kvzap"],
    "niah": ["--query-aware", "--kvzip", "--kvzap"],
    "perplexity": ["--kvzap"],
}
REGISTRY_FILTERS = {
    "multiturn_recall",
    "kvzip_reuse",
    "niah_served",
    "long_context",
    "llama_parity",
    "kvzap_parity",
}  # no --calibration
KVPRESS_PYTHON = os.environ.get("QFSERVE_KVPRESS_PYTHON", "")


def missing(file: str) -> str:
    """Why the mode writing ``<file>.json`` cannot run here ('' when it can)."""
    kvpress = ("kvzip_parity", "kvzap_parity")
    if file in kvpress and not (KVPRESS_PYTHON and Path(KVPRESS_PYTHON).exists()):
        return "needs a Python with torch, transformers and kvpress: set QFSERVE_KVPRESS_PYTHON"
    if file in ("vs_llama_cpp", "memory"):
        import subprocess

        from qfserve.testing import LLAMA_PYTHON, llama_tool

        if llama_tool("llama-server") is not None:
            return ""
        if file == "memory":
            return "needs llama.cpp's llama-server: bench/reference/llama_cpp_tools.sh builds it"
        found = (
            subprocess.run(
                [LLAMA_PYTHON, "-c", "import llama_cpp.server"], capture_output=True
            ).returncode
            == 0
        )
        if not found:
            return (
                "needs llama.cpp's llama-server (bench/reference/llama_cpp_tools.sh) or "
                "llama-cpp-python[server] (a Python with it named by QFSERVE_LLAMA_PYTHON)"
            )
    if file == "llama_parity":
        from qfserve.testing import llama_cpp_python

        if llama_cpp_python() is None:
            return "needs llama-cpp-python (bench/reference/llama_cpp_tools.sh)"
    if file == "kernel_cuda":
        if importlib.util.find_spec("torch") is None or importlib.util.find_spec("cupy") is None:
            return "needs torch and cupy with an NVIDIA GPU"
        import torch

        if not torch.cuda.is_available():
            return "needs an NVIDIA GPU (torch sees none)"
    return ""


def argv_for(file: str, out: Path) -> list[str]:
    s = owner(file)
    argv = [*s.mode(file), "--quick", "--out", str(out), *EXTRA.get(file, [])]
    if s.section == "quality" and file not in REGISTRY_FILTERS:
        argv += ["--calibration", "fresh"]
    if file in ("kvzip_parity", "kvzap_parity"):
        argv += ["--kvpress-python", KVPRESS_PYTHON]
    if file == "vs_llama_cpp":  # llama.cpp reads GGUF: the default model's, short
        argv += ["--model", "smollm2-135m-instruct", "--prompts", "64", "--reps", "1"]
    # the default model's GGUF (kvzap_parity: kvpress's side runs it with our surrogates)
    if file in ("memory", "llama_parity", "kvzap_parity"):
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
    """``quick(file)``: ``<file>.json`` as its study's mode wrote it on a quick run (run at the
    first ask)."""
    done: dict[str, dict[str, Any]] = {}

    def run(file: str) -> dict[str, Any]:
        if reason := missing(file):
            pytest.skip(reason)
        if file not in done:
            owner(file).main(argv_for(file, results))
            done[file] = json.loads((results / f"{file}.json").read_text())
        return done[file]

    return run
