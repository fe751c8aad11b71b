"""What every quality study does around its own measurement: load, calibrate, save.

A study parses its arguments with :func:`bench.cli.parser`, calls
:func:`open_study` for the model, its held-out corpus and (unless it makes its own) the
calibrated filters, measures, and ends with :meth:`Study.save`, which writes the JSON every
study shares (command line, quick flag, model identity, calibration) plus its own payload.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from bench.cli import command_line
from bench.harness import write_results
from bench.models import load
from bench.quality.calib import filters_for, with_learned
from bench.quality.data import heldout_corpus
from qfserve.engine.kv.kvzip import RepeatPrompt
from training.data import Corpus


@dataclass
class Study:
    """One study run: its arguments, the measured model and what it is measured with."""

    name: str
    args: argparse.Namespace
    argv: Sequence[str] | None
    started: float
    model: Any
    tokenizer: Any
    identity: dict[str, Any]
    corpus: Corpus
    filters: Any = None  # (n_layers, n_kv_heads, head_dim) calibrated filters, when loaded
    calibration: dict[str, Any] | None = None  # where the filters came from

    @cached_property
    def repeat(self) -> RepeatPrompt:
        """The tokenizer's reconstruction prompts (kvzip arms)."""
        return RepeatPrompt.for_tokenizer(self.tokenizer)

    def save(self, payload: dict[str, Any], *, calibration: Any = None) -> int:
        """Write ``<out>/<name>.json`` (shared fields + ``payload``); returns exit code 0.

        ``calibration`` replaces the record of the filters when the study made its own.
        """
        path = write_results(
            self.name,
            {
                "command": command_line(f"bench.quality.{self.name}", self.argv),
                "quick": self.args.quick,
                "model": self.identity,
                "calibration": self.calibration if calibration is None else calibration,
                **payload,
            },
            self.args.out,
            section="quality",
            started=self.started,
        )
        print(f"wrote {path}")
        return 0


def add_data_arguments(p: argparse.ArgumentParser) -> None:
    """``--length`` and ``--sequences``: the held-out windows a study measures on."""
    p.add_argument("--length", type=int, default=None, help="tokens per held-out sequence")
    p.add_argument("--sequences", type=int, default=None, help="held-out sequences per kind")


def open_study(
    name: str, args: argparse.Namespace, argv: Sequence[str] | None, *, calibrate: bool = True
) -> Study:
    """Load ``args.model``, its held-out corpus and (when ``calibrate``) its calibrated filters.

    The clock for the JSON's ``runtime_s`` starts here.
    """
    started = time.perf_counter()
    bm = load(args.model)
    study = Study(
        name, args, argv, started, bm.model, bm.tokenizer, bm.identity, heldout_corpus(bm.tokenizer)
    )
    if calibrate:
        study.filters, study.calibration = filters_for(
            bm.model,
            bm.tokenizer,
            bm.identity,
            mode=args.calibration,
            quick=args.quick,
            seed=args.seed,
        )
        if getattr(args, "traffic_artifacts", None):
            study.filters, learned = with_learned(
                study.filters, args.traffic_artifacts, bm.identity
            )
            study.calibration = {**study.calibration, "traffic_artifacts": learned}
    return study
