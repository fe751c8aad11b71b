"""qfserve against llama.cpp's server (llama-cpp-python), on the same GGUF file and prompts.

Streamed chat requests, greedy, EOS banned, unique prompts; arms interleaved: theirs, ours
full, ours with Q-Filters, theirs again (A/A). llama.cpp is an optional extra: install
``llama-cpp-python[server]`` (it compiles from PyPI) into this Python or another one named by
``QFSERVE_LLAMA_PYTHON``. ``--model`` must be a GGUF file or a catalog model (its GGUF).
"""

from __future__ import annotations

from typing import Any

from bench.studies import vs_mlx_lm


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return vs_mlx_lm.compare("llama_cpp", "vs_llama_cpp", __doc__, argv)


def render(d: dict[str, Any]) -> list[str]:
    """This study's section of ``bench/RESULTS.md``."""
    return vs_mlx_lm.render(d, "Against llama.cpp's server on the same GGUF")
