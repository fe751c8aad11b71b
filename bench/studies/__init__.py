"""The registry of studies: each a module here with its data, its measurement (``main(argv)``)
and its section of ``bench/RESULTS.md`` (``render(data)``, from the JSON ``main`` wrote);
importing this package imports no study (nor MLX).

A study that asks one question of several setups is one entry with modes: a package whose
modules each measure one mode and write one JSON file, named as before the modes were joined,
so every earlier result still renders. Settled studies live on as text in ``bench/ARCHIVE.md``.
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class Study:
    """One registered study; the smoke test skips a mode, saying so, when it ``needs`` more."""

    name: str  # on the command line; its module is named ``key``
    section: str  # ``quality`` (held-out accuracy, likelihood) or ``speed`` (time, memory)
    question: str  # what it answers, in one line
    subfolder: bool | tuple[str, ...] = False  # run_all.sh runs it (or these files) elsewhere
    needs: str = ""  # what it needs beyond the package
    option: str = ""  # the flag that picks a mode (``--mode``)
    modes: tuple[
        tuple[str, str], ...
    ] = ()  # (mode, the JSON file it writes); the first is the default

    @property
    def key(self) -> str:
        return self.name.replace("-", "_")

    @property
    def files(self) -> tuple[str, ...]:
        """The JSON files (without ``.json``) its modes write, in the registry's order."""
        return tuple(file for _, file in self.modes) or (self.key,)

    def module(self, file: str | None = None) -> ModuleType:
        """The module that measures and renders ``file`` (default: the first mode's)."""
        part = f".{file or self.files[0]}" if self.modes else ""
        return importlib.import_module(f"bench.studies.{self.key}{part}")

    def elsewhere(self, file: str) -> bool:
        """Whether ``run_all.sh`` writes ``file`` into a subfolder (not listed as missing)."""
        return self.subfolder is True or file in (self.subfolder or ())

    def mode(self, file: str) -> list[str]:
        """The arguments that pick the mode writing ``file`` (none for a single-mode study)."""
        return [self.option, dict((f, m) for m, f in self.modes)[file]] if self.modes else []

    def file_for(self, argv: Sequence[str]) -> str:
        """The JSON file the mode chosen in ``argv`` writes."""
        if not self.modes:
            return self.key
        p = argparse.ArgumentParser(add_help=False)
        p.add_argument(self.option, choices=[m for m, _ in self.modes], default=self.modes[0][0])
        chosen = getattr(p.parse_known_args(list(argv))[0], self.option.lstrip("-"))
        return dict(self.modes)[chosen]

    def main(self, argv: Sequence[str]) -> Any:
        return self.module(self.file_for(argv)).main(list(argv))


def _modes(*files: str, **named: str) -> tuple[tuple[str, str], ...]:
    return tuple((f.replace("_", "-"), f) for f in files) + tuple(
        (m.replace("_", "-"), f) for m, f in named.items()
    )


LLAMA_TOOLS = "bench/reference/llama_cpp_tools.sh"

STUDIES = {
    s.name: s
    for s in (
        Study("perplexity", "quality", "streaming perplexity per budget and arm, code and prose"),
        # The needle is the question; the haystack (a synthetic pass key or English prose) an axis.
        Study(
            "retrieval",
            "quality",
            "needle accuracy by length, compression and depth, in filler or in prose",
            option="--haystack",
            modes=_modes(passkey="retrieval", prose="niah"),
        ),
        Study(
            "niah-served", "quality", "the needle through the server with default settings", True
        ),
        Study(
            "long-context",
            "quality",
            "needle and KV bytes at 2k-32k on sliding + global layers",
            True,
        ),
        # Both ask what a later turn still finds: a pass key in a chat, or facts in a document
        # read once and compressed by KVzip in the prompt cache.
        Study(
            "multiturn-recall",
            "quality",
            "what turn 1 said, asked turns later: a pass key in a chat, facts in a document",
            subfolder=("kvzip_reuse",),
            option="--conversation",
            modes=_modes(chat="multiturn_recall", document="kvzip_reuse"),
        ),
        # Both run the same inputs through a reference implementation and compare what comes out.
        Study(
            "parity",
            "quality",
            "our outputs against a reference implementation on the same inputs",
            True,
            f"llama-cpp-python on llama.cpp's libllama ({LLAMA_TOOLS}); kvpress, kvpress-kvzap: a "
            "Python with torch, transformers and kvpress (--kvpress-python)",
            option="--against",
            modes=_modes(
                llama_cpp="llama_parity", kvpress="kvzip_parity", kvpress_kvzap="kvzap_parity"
            ),
        ),
        # One decode step, timed from every side: against the full cache and context (step),
        # batched, and by kind of work.
        Study(
            "decode",
            "speed",
            "the decode step: eviction against the full cache, batched, profiled",
            option="--mode",
            modes=_modes(step="decode", batch="batch_step", profile="profile"),
        ),
        # What a prompt costs before the first token: eviction's, KVzip's pass, KVzap's scores.
        Study(
            "prefill-cost",
            "speed",
            "what eviction, KVzip's pass and KVzap's scores add to a prefill",
            True,
            option="--mode",
            modes=_modes(ttft="ttft", kvzip="kvzip_cost", kvzap="kvzap_cost"),
        ),
        # Our server against llama.cpp's on the same model: speed or resident memory.
        Study(
            "vs",
            "speed",
            "qfserve against llama.cpp's server on the same GGUF: speed, resident memory",
            True,
            f"llama-server ({LLAMA_TOOLS}) or llama-cpp-python[server] for llama-cpp",
            option="--against",
            modes=_modes(llama_cpp="vs_llama_cpp", llama_cpp_memory="memory"),
        ),
        Study(
            "batching",
            "speed",
            "continuous batching: aggregate tok/s and TTFT per stream count, and under an open load",
            option="--load",
            modes=_modes(burst="batching", open="open_load"),
        ),
        Study(
            "kernel-cuda",
            "speed",
            "the fused eviction kernel on an NVIDIA GPU: parity, timing",
            True,
            "an NVIDIA GPU with torch and cupy",
        ),
    )
}


def study(name: str) -> Study:
    """The registered study called ``name`` (``_`` and ``-`` alike)."""
    found = STUDIES.get(name.replace("_", "-"))
    if found is None:
        raise ValueError(f"study must be one of {', '.join(STUDIES)}; got {name!r}")
    return found


def owner(file: str) -> Study:
    """The study whose mode writes ``<file>.json`` (a JSON's ``benchmark``)."""
    for s in STUDIES.values():
        if file in s.files:
            return s
    raise ValueError(f"no registered study writes {file}.json")
