"""qfserve against llama.cpp's server (llama-cpp-python), on the same GGUF file and prompts.

Needs ``llama-cpp-python[server]`` in this Python or the one ``QFSERVE_LLAMA_PYTHON`` names;
``--model`` must be a GGUF file or a catalog model (its GGUF).
"""

from __future__ import annotations

from functools import partial

from bench.studies import vs_mlx_lm

main = partial(vs_mlx_lm.compare, "llama_cpp", "vs_llama_cpp", __doc__)
render = partial(vs_mlx_lm.render, title="Against llama.cpp's server on the same GGUF")
