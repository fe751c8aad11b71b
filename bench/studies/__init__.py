"""The registry of studies: each a module here with its data, its measurement (``main(argv)``)
and its section of ``bench/RESULTS.md`` (``render(data)``, from the JSON ``main`` wrote);
importing this package imports no study (nor MLX)."""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Study:
    """One registered study; the smoke test skips it, saying so, when it ``needs`` more."""

    name: str  # on the command line; its module and its JSON file are named ``key``
    section: str  # ``quality`` (held-out accuracy, likelihood) or ``speed`` (time, memory)
    question: str  # what it answers, in one line
    subfolder: bool = False  # run_all.sh runs it into a subfolder: not listed as missing
    needs: str = ""  # what it needs beyond the package

    @property
    def key(self) -> str:
        return self.name.replace("-", "_")

    def module(self) -> ModuleType:
        return importlib.import_module(f"bench.studies.{self.key}")


STUDIES = {s.name: s for s in (
    Study("geometry", "quality", "are the queries anisotropic, and does the filter's sign hold?"),
    Study("attention", "quality", "does each scorer's score predict the attention a key receives?"),
    Study("perplexity", "quality", "streaming perplexity per budget and arm, code and prose"),
    Study("retrieval", "quality", "pass-key accuracy by length, compression and needle depth"),
    Study("stability", "quality", "how stable is the calibration across samples and texts?"),
    Study("niah", "quality", "a needle sentence in English prose, depth x length"),
    Study("niah-served", "quality", "the needle through the server with default settings", True),
    Study("llama-parity", "quality", "greedy text and log-probs against llama.cpp on the same file",
          True, "llama-cpp-python on llama.cpp's libllama (bench/reference/llama_cpp_tools.sh)"),
    Study("long-context", "quality", "needle and KV bytes at 2k-32k on sliding + global layers",
          True),
    Study("selfcal-text", "quality", "whose queries make a prompt-calibrated filter work?", True),
    Study("multiturn-recall", "quality", "a pass key from turn 1, asked turns later"),
    Study("traffic", "quality", "Q-Filters learned from traffic, as a server learns them", True),
    Study("kvzip-parity", "quality", "our KVzip against NVIDIA kvpress's KVzipPress", True,
          "a Python with torch, transformers and kvpress (--kvpress-python)"),
    Study("kvzip-reuse", "quality", "KVzip through the prompt cache: facts asked turns later",
          True),
    Study("decode", "speed", "decode ms/step, eviction overhead and memory against context"),
    Study("ttft", "speed", "time to first token, eviction against the full cache"),
    Study("server-overhead", "speed", "streamed HTTP against the worker against in-process"),
    Study("vs-mlx-lm", "speed", "qfserve against mlx_lm.server on the same prompts"),
    Study("vs-llama-cpp", "speed", "qfserve against llama.cpp's server on the same GGUF", True,
          "llama-server (bench/reference/llama_cpp_tools.sh) or llama-cpp-python[server]"),
    Study("memory", "speed", "resident memory against llama-server on the same GGUF and context",
          True, "llama.cpp's llama-server (bench/reference/llama_cpp_tools.sh)"),
    Study("distributed", "speed", "one process against the model split over ranks (lockstep)"),
    Study("bandwidth", "speed", "memory bandwidth against the bytes a decode step reads"),
    Study("structured", "speed", "what a JSON-schema constraint costs per token"),
    Study("batching", "speed", "continuous batching: aggregate tok/s and TTFT per stream count"),
    Study("multiturn", "speed", "multi-turn chat: TTFT, KV bytes and RSS per turn, with reuse"),
    Study("batch-step", "speed", "one batched decode step: our caches against mlx-lm's"),
    Study("selfcal-prefill", "speed", "self-calibration's cost on a prefill"),
    Study("refine-step", "speed", "the decode step of chunked and head-adaptive caches"),
    Study("blas", "speed", "OpenBLAS from PyPI against the system's, side by side", True,
          "both the pip (ngsolve-openblas) and the system (libopenblas0-pthread) OpenBLAS"),
    Study("profile", "speed", "a decode step and a prefill chunk, by kind of work"),
    Study("kvzip-cost", "speed", "KVzip's reconstruction pass against a plain prefill", True),
    Study("kernel-cuda", "speed", "the fused eviction kernel on an NVIDIA GPU: parity, timing",
          True, "an NVIDIA GPU with torch and cupy"),
)}  # fmt: skip


def study(name: str) -> Study:
    """The registered study called ``name`` (``_`` and ``-`` alike)."""
    found = STUDIES.get(name.replace("_", "-"))
    if found is None:
        raise ValueError(f"study must be one of {', '.join(STUDIES)}; got {name!r}")
    return found
