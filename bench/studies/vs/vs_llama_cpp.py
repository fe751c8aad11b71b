"""qfserve against llama.cpp's server, on the same GGUF file and prompts.

Theirs is llama.cpp's own ``llama-server`` where it is built (``bench/reference/
llama_cpp_tools.sh``, or ``QFSERVE_LLAMA_SERVER``), else llama-cpp-python's server (in this
Python or the one ``QFSERVE_LLAMA_PYTHON`` names); ``--model`` must be a GGUF file or a
catalog model (its GGUF).
"""

from __future__ import annotations

from typing import Any

from bench.studies.vs import vs_mlx_lm
from qfserve import testing as servers


def main(argv: list[str] | None = None) -> dict[str, Any]:
    kind = "llama_server" if servers.llama_tool("llama-server") else "llama_cpp"
    return vs_mlx_lm.compare(kind, "vs_llama_cpp", __doc__, argv)


def render(d: dict[str, Any]) -> list[str]:
    return vs_mlx_lm.render(d, title="Against llama.cpp's server on the same GGUF")
