"""One study's run: the model loaded as the server loads it and named exactly, the filters
its arms use, the machine it ran on, and the JSON it writes."""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from bench.cli import REPO, command_line, parse, parser
from bench.resume import Progress, jsonable, measured, resume


@dataclass
class Run:
    """One study run: its arguments, the model loaded as the server loads it and named exactly
    (:func:`identity`), and the filters its arms use."""

    name: str
    args: argparse.Namespace
    argv: Sequence[str] | None
    loaded: Any  # qfserve.engine.models.loading.LoadedModel
    folder: Path  # what servers a study starts load (a GGUF's converted folder)
    identity: dict[str, Any]
    started: float = field(default_factory=time.perf_counter)
    calibrated: Any = None  # (n_layers, n_kv_heads, head_dim) filters the study calibrated
    calibration: dict[str, Any] | None = None  # where they came from
    surrogate: Any = None  # the model's KVzap surrogates, for kvzap arms (--kvzap)

    @property
    def model(self) -> Any:
        return self.loaded.model

    @property
    def tokenizer(self) -> Any:
        return self.loaded.tokenizer

    @property
    def context_length(self) -> int:
        return int(self.loaded.context_length)

    @cached_property
    def served(self) -> tuple[Any, str]:
        """The server's filters (the registry's, else none: the key-SVD fallback) and source."""
        from qfserve.engine.filters.artifact import resolve_filters

        return resolve_filters(
            self.model, self.identity["model_id"], fingerprint=self.identity["fingerprint"]
        )

    @property
    def filters(self) -> Any:
        """The study's calibrated filters when it made them, else the server's."""
        return self.calibrated if self.calibration is not None else self.served[0]

    @cached_property
    def corpus(self) -> Any:
        from bench.data import heldout_corpus

        return heldout_corpus(self.tokenizer)

    @cached_property
    def repeat(self) -> Any:
        """The tokenizer's reconstruction prompts (kvzip arms)."""
        from qfserve.engine.kv.kvzip import RepeatPrompt

        return RepeatPrompt.for_tokenizer(self.tokenizer)

    @cached_property
    def log(self) -> Progress:
        return Progress(self.name)

    def logged(
        self, fields: tuple[str, ...], todo: Sequence, measure: Callable, desc: str, **keep: Any
    ) -> list[dict]:
        """:func:`measured` on the study's log ``<out>/<name>.jsonl``, its records (those
        :func:`resume`'s ``keep`` accepts; none in a quick run) keyed by their ``fields``."""
        log = Path(self.args.out) / f"{self.name}.jsonl"
        done = resume(log, lambda r: tuple(r[f] for f in fields), fresh=self.args.quick, **keep)
        return measured(log, done, todo, measure, desc)

    def title(self, what: str) -> str:
        """A plot's title: ``what``, after the measured model's path and checkpoint."""
        return f"{self.identity['path']} {self.identity['checkpoint']}: {what}"

    def describe(self) -> dict[str, Any]:
        """The model's identity and where the server's filters come from (speed studies)."""
        return {**self.identity, "filter_source": self.served[1]}

    def save(
        self,
        payload: dict[str, Any],
        *,
        model: dict[str, Any] | None = None,
        calibration: Any = None,
        echo: bool = True,
    ) -> dict[str, Any]:
        """:func:`write_results` with the model, machine and runtime before ``payload`` (a
        quality study's calibration too)."""
        from bench.studies import owner

        quality = owner(self.name).section == "quality"
        data: dict[str, Any] = {
            "machine": machine(),
            "runtime_s": round(time.perf_counter() - self.started, 1),
            "model": model or (self.identity if quality else self.describe()),
        }
        if quality:
            data["calibration"] = self.calibration if calibration is None else calibration
        return write_results(self.name, self.args, self.argv, {**data, **payload}, echo=echo)


def write_results(
    name: str,
    args: argparse.Namespace,
    argv: Sequence[str] | None,
    payload: dict[str, Any],
    *,
    echo: bool = True,
) -> dict[str, Any]:
    """Write ``<out>/<name>.json`` (the study, its section, time and command, then ``payload``),
    print its section of the results page unless not ``echo`` (a partial write), return it."""
    from bench.report import render_study
    from bench.studies import owner

    written = jsonable(
        {
            "benchmark": name,
            "section": owner(name).section,
            "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "command": command_line(name, argv),
            "quick": args.quick,
            **payload,
        }
    )
    path = Path(args.out) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(written, indent=1) + "\n")
    if echo:
        print("\n".join(render_study(name, written)).replace("](results/", "]("))
        print(f"\nwrote {path}")
    return written


def start(
    name: str,
    argv: Sequence[str] | None,
    doc: str,
    *,
    calibration: bool = False,
    flags: dict[str, dict] | None = None,
    options: Sequence[Callable] = (),
    **sized: Any,
) -> Run:
    """Parse ``argv`` with a :func:`parser` (``doc``, ``calibration``, ``sized``), ``flags``
    (option: its ``add_argument`` keywords) and ``options(parser)``, then load ``args.model``
    with the server's loader (a GGUF file or catalog name becomes its converted folder); with
    ``calibration``, calibrated filters per ``--calibration`` too (and, with ``--kvzap``, the
    model's KVzap surrogates). ``name`` is the JSON file the study's mode writes."""
    from qfserve.engine.models.loading import load_model, resolve_model_ref

    p = parser(doc, file=name, calibration=calibration, **sized)
    for flag, kwargs in (flags or {}).items():
        p.add_argument(flag, **kwargs)
    for add in options:
        add(p)
    args = parse(p, argv)
    started = time.perf_counter()  # the JSON's runtime_s counts from here
    folder = Path(resolve_model_ref(args.model))
    loaded = load_model(str(folder))
    run = Run(name, args, argv, loaded, folder, identity(loaded, folder), started)
    if calibration:
        from bench.arms import filters_for
        from bench.surrogates import surrogate_for

        where = {"mode": args.calibration, "quick": args.quick, "seed": args.seed}
        run.calibrated, run.calibration = filters_for(
            run.model, run.tokenizer, run.identity, **where
        )
        if getattr(args, "kvzap", False):
            run.surrogate, run.calibration["kvzap"] = surrogate_for(
                run.model, run.tokenizer, run.identity, **where
            )
    return run


def identity(loaded: Any, folder: Path) -> dict[str, Any]:
    """What exactly was measured: folder, served name, model id, weight hashes and shape."""
    from mlx.utils import tree_flatten

    from qfserve.calibrations import model_info

    model, digest = loaded.model, hashlib.sha1()
    for w in sorted(folder.glob("*.safetensors")):
        digest.update(w.read_bytes())
    state_file = folder / "training_state.json"
    state = json.loads(state_file.read_text()) if state_file.is_file() else None
    modules = model_info.attention_modules(model)
    n_heads, n_kv_heads, head_dim = model_info.head_counts(modules[0], model)
    resolved = folder.resolve()
    return {
        "name": loaded.name,
        "path": str(resolved.relative_to(REPO)) if resolved.is_relative_to(REPO) else str(folder),
        "model_id": loaded.model_id,
        "weights_sha1": digest.hexdigest()[:12],
        "fingerprint": model_info.model_fingerprint(model, loaded.config),
        "training_state": state,
        "checkpoint": checkpoint_label(state, loaded.name),
        "n_layers": len(modules),
        "n_heads": n_heads,
        "n_kv_heads": n_kv_heads,
        "head_dim": head_dim,
        "hidden_size": int(loaded.config.get("hidden_size", 0)),
        "max_context": model_info.max_context(model) or loaded.context_length,
        "weight_bytes": sum(v.nbytes for _, v in tree_flatten(model.parameters())),
    }


def checkpoint_label(state: dict[str, Any] | None, name: str = "") -> str:
    """``"<run> step 1952 (18,711,040 training tokens)"``; a pretrained model: its name."""
    if not state:
        return f"{name} (pretrained)" if name else "unknown (no training_state.json)"
    run = f"{state['run']} " if state.get("run") else ""
    return f"{run}step {state.get('step')} ({state.get('tokens_seen', 0):,} training tokens)"


def _training_running() -> bool:
    # Another project process (the model's training) often shares the cores; say so.
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):
            if b"training.train" in cmdline.read_bytes():
                return True
    return False


def machine() -> dict[str, Any]:
    """Platform, MLX, BLAS, cores and how busy the machine was when the run wrote its JSON."""
    import mlx.core as mx

    from qfserve.engine.models.blas import blas_summary

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.machine(),
        "mlx": mx.__version__,
        "device": str(mx.default_device()),
        "blas": blas_summary(),
        "cpu_count": os.cpu_count(),
    }
    if hasattr(os, "getloadavg"):
        info["load_average"] = [round(x, 2) for x in os.getloadavg()]
    if _training_running():
        info["notes"] = (
            "shared machine: a model was training in the background on the same cores "
            "during this run, so absolute timings are inflated and noisy; read the ratios "
            "against the A/A rows"
        )
    return info
