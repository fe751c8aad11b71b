"""qfserve: an OpenAI-compatible local LLM server on MLX whose KV cache is bounded by eviction.

Rooms, each depending only on those below it (``.importlinter`` checks the order):

* :mod:`qfserve.server` -- the FastAPI app, its request schemas, settings and CLI.
* :mod:`qfserve.engine` -- generation: serving (one model thread, continuous batching),
  text (prompts, sampling, structured output, tools), reuse (kept caches, disk), filters
  (where a model's Q-Filters come from), models (loading, catalog, GGUF), kv (the eviction
  caches and their scorers).
* :mod:`qfserve.calibrations` -- computing, storing and finding calibrated filters.
* :mod:`qfserve.kernels` -- the fused eviction kernels (Metal, CUDA) and their plain-MLX twin.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("qfserve")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"
