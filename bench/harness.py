"""What every study shares: its command line, the measured model, timing, results, progress and
plots. Arms run interleaved in one process and are read as ratios against a reference arm."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"
DEFAULT_MODEL = "smollm2-135m-instruct"  # what `qfserve` serves with no --model
BUNDLED = "qfserve-tiny"
RESULTS_FOLDERS = {DEFAULT_MODEL: "smollm2", BUNDLED: BUNDLED}  # bench/results/<folder>/
MiB = 2**20


# -- command line --------------------------------------------------------------------------


def parser(doc: str, *, reps: int | None = None, calibration: bool = False,
           **sized: Any) -> argparse.ArgumentParser:  # fmt: skip
    """The shared arguments, plus ``--reps``/``--calibration`` when asked; each ``name=(full,
    quick, help)`` adds ``--name`` defaulting to ``full``, or ``quick`` with ``--quick``."""
    p = argparse.ArgumentParser(description=doc.strip().splitlines()[0])
    p.add_argument("--model", default=None, help=f"catalog name, GGUF file, mlx-lm folder or "
                   f"hub id (default: {DEFAULT_MODEL}; with --quick: {BUNDLED})")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="CI-sized smoke run (seconds)")
    p.add_argument("--out", type=Path, default=None, help="results folder (default: bench/results/<model>)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    if reps is not None:
        sized["reps"] = (reps, 2, "timed repetitions per arm")
    if calibration:
        p.add_argument("--calibration", choices=("auto", "registry", "fresh"), default="auto",
                       help="calibrated filters: the registry's artifact if one exists (auto), "
                       "only the registry, or always calibrate afresh on held-in training text")  # fmt: skip
    for name, spec in sized.items():
        full, quick, *about = spec if isinstance(spec, tuple) else (spec, spec)
        many = isinstance(quick, list)
        if full is not None:
            about.append(f"default {_shown(full)}; quick {_shown(quick)}")
        p.add_argument(f"--{name.replace('_', '-')}", type=type(quick[0] if many else quick),
                       nargs="+" if many else None, default=None, help="; ".join(about))  # fmt: skip
    p.set_defaults(sized={k: v if isinstance(v, tuple) else (v, v) for k, v in sized.items()})
    return p


def _shown(value: Any) -> str:
    return " ".join(map(str, value)) if isinstance(value, list) else str(value)


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse and fill the defaults that depend on other arguments (model, out, sizes)."""
    args = p.parse_args(argv)
    args.model = args.model or (BUNDLED if args.quick else DEFAULT_MODEL)
    args.out = args.out or results_dir(args.model)
    for name, (full, quick, *_) in args.sized.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if hasattr(args, "reps") and args.reps < 1:
        p.error(f"--reps must be >= 1, got {args.reps}")
    return args


def command_line(study: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces this run: ``python -m bench <study> <arguments>``."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python -m bench", study.replace("_", "-"), *args])


def results_dir(ref: str) -> Path:
    """Default results folder for ``--model ref``: ``bench/results/<short name>``."""
    path = Path(ref)
    name = (path.stem if path.suffix.lower() == ".gguf" else path.name) or "model"
    return RESULTS_DIR / RESULTS_FOLDERS.get(ref, name)


# -- the measured model and one study's run -------------------------------------------------


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

        return resolve_filters(self.model, self.identity["model_id"],
                               fingerprint=self.identity["fingerprint"])  # fmt: skip

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

    def save(self, payload: dict[str, Any], *, model: dict[str, Any] | None = None,
             calibration: Any = None, echo: bool = True) -> dict[str, Any]:  # fmt: skip
        """:func:`write_results` with the model, machine and runtime before ``payload`` (a
        quality study's calibration too)."""
        from bench.studies import study

        quality = study(self.name).section == "quality"
        data: dict[str, Any] = {"machine": machine(),
                                "runtime_s": round(time.perf_counter() - self.started, 1),
                                "model": model or (self.identity if quality else self.describe())}  # fmt: skip
        if quality:
            data["calibration"] = self.calibration if calibration is None else calibration
        return write_results(self.name, self.args, self.argv, {**data, **payload}, echo=echo)


def write_results(name: str, args: argparse.Namespace, argv: Sequence[str] | None,
                  payload: dict[str, Any], *, echo: bool = True) -> dict[str, Any]:  # fmt: skip
    """Write ``<out>/<name>.json`` (the study, its section, time and command, then ``payload``),
    print its section of the results page unless not ``echo`` (a partial write), return it."""
    from bench.report import render_study
    from bench.studies import study

    written = jsonable({"benchmark": name, "section": study(name).section,
                        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                        "command": command_line(name, argv), "quick": args.quick, **payload})  # fmt: skip
    path = Path(args.out) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(written, indent=1) + "\n")
    if echo:
        print("\n".join(render_study(name, written)).replace("](results/", "]("))
        print(f"\nwrote {path}")
    return written


def open_run(
    name: str, args: argparse.Namespace, argv: Sequence[str] | None, *, calibrate: bool = False
) -> Run:
    """Load ``args.model`` with the server's loader (a GGUF file or catalog name becomes its
    converted folder); with ``calibrate``, calibrated filters per ``--calibration`` too."""
    from qfserve.engine.models.loading import load_model, resolve_model_ref

    started = time.perf_counter()  # the JSON's runtime_s counts from here
    folder = Path(resolve_model_ref(args.model))
    loaded = load_model(str(folder))
    run = Run(name, args, argv, loaded, folder, identity(loaded, folder), started)
    if calibrate:
        from bench.arms import filters_for

        run.calibrated, run.calibration = filters_for(
            run.model, run.tokenizer, run.identity, mode=args.calibration, quick=args.quick,
            seed=args.seed, traffic=getattr(args, "traffic_artifacts", None))  # fmt: skip
    return run


def start(name: str, argv: Sequence[str] | None, doc: str, *, calibration: bool = False,
          flags: dict[str, dict] | None = None, options: Sequence[Callable] = (),
          **sized: Any) -> Run:  # fmt: skip
    """:func:`open_run` on ``argv`` parsed by a :func:`parser` (``doc``, ``calibration``,
    ``sized``) with ``flags`` (option: its ``add_argument`` keywords) and ``options(parser)``."""
    p = parser(doc, calibration=calibration, **sized)
    for flag, kwargs in (flags or {}).items():
        p.add_argument(flag, **kwargs)
    for add in options:
        add(p)
    return open_run(name, parse(p, argv), argv, calibrate=calibration)


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


# -- timing ---------------------------------------------------------------------------------


def interleave(
    arms: dict[str, Callable[[], float]],
    reps: int,
    warmup: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, list[float]]:
    """Call each arm ``warmup + reps`` times, round-robin, keeping the measurements after the
    warm-up; ``progress(done, total)`` after every round."""
    samples: dict[str, list[float]] = {name: [] for name in arms}
    for rep in range(warmup + reps):
        for name, fn in arms.items():
            value = fn()
            if rep >= warmup:
                samples[name].append(value)
        if progress is not None:
            progress(rep + 1, warmup + reps)
    return samples


def summary(values: Sequence[float | None]) -> dict[str, float]:
    """Median, interquartile range, min and max of ``values`` (``None`` and NaN dropped)."""
    v = [float(x) for x in values if x is not None and math.isfinite(x)]
    if not v:
        return {"median": math.nan, "q1": math.nan, "q3": math.nan, "n": 0}
    q = statistics.quantiles(v, n=4) if len(v) >= 2 else [v[0]] * 3
    return {"median": statistics.median(v), "q1": q[0], "q3": q[2], "min": min(v),
            "max": max(v), "n": len(v)}  # fmt: skip


def ratio_row(samples: dict[str, list[float]], arm: str, reference: str) -> dict[str, Any]:
    """Median of per-repetition ratios ``arm / reference`` (pairs from the same round)."""
    ratios = [a / b for a, b in zip(samples[arm], samples[reference], strict=True)]
    return {"arm": arm, "reference": reference, **summary(ratios)}


def summaries(samples: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    return {arm: summary(values) for arm, values in samples.items()}


def ratios(samples: dict[str, list[float]], reference: str, arms: Any) -> list[dict[str, Any]]:
    return [ratio_row(samples, arm, reference) for arm in arms]


def compare_arms(
    run: Run, arms: dict[str, Callable[[], float]], label: str, reference: str
) -> tuple[dict[str, list[float]], dict[str, dict[str, float]], list[dict[str, Any]]]:
    """Interleave ``arms`` for ``--reps`` rounds: the samples, their :func:`summaries` and
    every other arm's :func:`ratio_row` against ``reference``."""
    samples = interleave(arms, run.args.reps, progress=run.log.rounds(label))
    others = [a for a in samples if a != reference]
    return samples, summaries(samples), ratios(samples, reference, others)


@dataclass(frozen=True)
class StreamTiming:
    """One streamed request, timed on the client: seconds, from sending the request."""

    ttft: float  # first chunk with non-empty text
    total: float  # stream finished
    completion_tokens: int
    prompt_tokens: int
    chunks: int
    kv_cache: dict[str, Any] | None = None
    chunk_times: tuple[float, ...] = ()  # each text chunk's arrival

    @property
    def itl(self) -> float:
        """Mean inter-token latency after the first token (seconds)."""
        return (self.total - self.ttft) / max(1, self.completion_tokens - 1)

    @property
    def decode_tps(self) -> float:
        return 1.0 / self.itl


def chat_events(client: Any, url: str, body: dict, timeout: float = 600) -> Iterator[dict]:
    """The events of a streamed ``/v1/chat/completions`` POST with ``client`` (httpx), usage
    included, up to ``[DONE]``; an HTTP or stream error raises."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=timeout) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            if (data := line[5:].strip()) == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"{url}: stream error: {event['error']}")
            yield event


def stream_chat(client: Any, url: str, body: dict[str, Any]) -> StreamTiming:
    """POST a streamed ``/v1/chat/completions`` with ``client`` (httpx) and time its chunks."""
    times: list[float] = []
    usage, kv = {}, None
    tic = time.perf_counter()
    for event in chat_events(client, url, body):
        for choice in event.get("choices") or ():
            if (choice.get("delta") or {}).get("content"):
                times.append(time.perf_counter() - tic)
        usage = event.get("usage") or usage
        kv = event.get("kv_cache") or kv
    total = time.perf_counter() - tic
    if not times:
        raise RuntimeError(f"{url}: the stream carried no text")
    return StreamTiming(times[0], total, int(usage.get("completion_tokens", len(times))),
                        int(usage.get("prompt_tokens", 0)), len(times), kv, tuple(times))  # fmt: skip


def start_worker(run: Run, **config: Any) -> Any:
    """The engine's in-process ``Worker`` (``EngineConfig(**config)``) on ``run``'s loaded
    model, started and ready."""
    from qfserve.engine.serving.config import EngineConfig
    from qfserve.engine.serving.worker import Worker

    worker = Worker(EngineConfig(**config), loader=lambda _ref: run.loaded)
    worker.start()
    deadline = time.monotonic() + 60
    while not worker.ready:
        if worker.status not in ("loading", "ready") or time.monotonic() > deadline:
            raise RuntimeError(f"in-process worker not ready: {worker.status} {worker.error}")
        time.sleep(0.05)
    return worker


async def worker_events(worker: Any, request: Any) -> AsyncIterator[Any]:
    """The events of ``request`` on ``worker`` up to its ``Finished``; a ``Failed`` raises."""
    from qfserve.engine.text.requests import Failed, Finished

    job = worker.submit(request, asyncio.get_running_loop())
    while True:
        event = await job.next_event()
        if isinstance(event, Failed):
            raise RuntimeError(f"worker: {event.kind}: {event.message}")
        yield event
        if isinstance(event, Finished):
            return


# -- results --------------------------------------------------------------------------------


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


def rss_bytes(pid: int | None = None) -> int:
    """Resident memory of process ``pid`` (this one by default)."""
    import psutil

    return int(psutil.Process(pid).memory_info().rss)


def jsonable(x: Any) -> Any:
    """``x`` with numpy values as lists and numbers, NaN as ``None`` and paths as strings."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "tolist"):  # numpy arrays and scalars
        return jsonable(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return None  # JSON has no NaN
    return str(x) if isinstance(x, Path) else x


def read_jsonl(path: Path, keep: Callable[[dict[str, Any]], bool] = lambda r: True) -> Iterator[dict]:  # fmt: skip
    """The records of a study's log that ``keep`` accepts (none if the file is missing)."""
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip() and keep(rec := json.loads(line)):
                yield rec


def resume(path: Path, key: Callable[[dict[str, Any]], Any], *, fresh: bool = False,
           keep: Callable[[dict[str, Any]], bool] = lambda r: True) -> dict[Any, dict]:  # fmt: skip
    """The records of a study's log that ``keep`` accepts, by ``key``; with ``fresh`` (quick
    runs) the log is deleted first."""
    if fresh:
        path.unlink(missing_ok=True)
    return {key(r): r for r in read_jsonl(path, keep)}


def measured(
    log: Path | None, done: dict[Any, dict], todo: Sequence[Any], measure: Callable, desc: str
) -> list[dict[str, Any]]:
    """The record of each key of ``todo``: read back (``done``, from :func:`resume`) or
    ``measure(*key)``, appended to ``log`` at once (if any) so that a stopped run resumes."""
    with progress(total=len(todo), desc=desc) as bar:
        for key in todo:
            if key not in done:
                done[key] = measure(*key)
                if log is not None:  # appended and closed at once: a stopped run resumes
                    log.parent.mkdir(parents=True, exist_ok=True)
                    with log.open("a") as f:
                        f.write(json.dumps(jsonable(done[key])) + "\n")
            bar.update(1)
    return [done[key] for key in todo]


# -- progress and plots ---------------------------------------------------------------------


def progress(**kwargs: Any) -> Any:
    """A tqdm bar; in a log file (no terminal) it writes a line every 30 s, not every step."""
    from tqdm import tqdm

    if not sys.stderr.isatty():
        kwargs.setdefault("mininterval", 30.0)
    return tqdm(**kwargs)


class Progress:
    """One line per step on stderr, with the elapsed time: ``[decode 12.3s] context 1024``."""

    def __init__(self, study: str) -> None:
        self.study, self.start = study, time.perf_counter()

    def __call__(self, message: str) -> None:
        elapsed = time.perf_counter() - self.start
        print(f"[{self.study} {elapsed:6.1f}s] {message}", file=sys.stderr, flush=True)

    def rounds(self, label: str) -> Callable[[int, int], None]:
        """A callback for :func:`interleave`."""
        return lambda done, total: self(f"{label}: round {done}/{total}")


COLORS = {
    "full": "black", "qfilters": "tab:blue", "self": "tab:purple", "traffic": "tab:pink",
    "traffic/passkey": "tab:gray", "snapkv": "tab:olive", "tova": "tab:cyan",
    "kvzip": "darkgoldenrod", "fallback": "tab:orange", "knorm": "tab:green",
    "streaming": "tab:red", "recency": "tab:red", "fallback+": "tab:orange",
    "fallback-": "tab:brown",
}  # fmt: skip


def color(method: str, variant: str = "") -> str:
    """An arm's colour: its variant's (``traffic/passkey``) where it has one, else its
    method's."""
    return COLORS.get(f"{method}/{variant}", COLORS[method])


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def subplots(nrows: int = 1, ncols: int = 1, **kwargs: Any) -> tuple[Any, Any]:
    """A figure of ``nrows x ncols`` panels, always as a 2-D array of axes."""
    kwargs.setdefault("figsize", (5.0 * ncols, 3.6 * nrows))
    kwargs.setdefault("squeeze", False)
    return pyplot().subplots(nrows, ncols, **kwargs)


def save_plot(fig: Any, out: Path, name: str, title: str = "") -> str:
    """Save ``fig`` as ``<out>/<name>.png``, close it and return the file's name."""
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / f"{name}.png", dpi=110)
    pyplot().close(fig)
    return f"{name}.png"


def log2_axis(ax: Any, ticks: Sequence[int], *, logy: bool = False) -> None:
    """Log-2 x axis labelled only at ``ticks`` (no minor-tick clutter); optionally log y."""
    from matplotlib.ticker import NullLocator, ScalarFormatter

    ax.set_xscale("log", base=2)
    ax.set_xticks(list(ticks), [str(t) for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    if logy:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(ScalarFormatter())


def errorbars(stats: Sequence[dict[str, float]], scale: float = 1.0) -> tuple[list, list]:
    """Medians and the interquartile range, times ``scale``, as matplotlib's asymmetric
    ``yerr``."""
    med = [s["median"] * scale for s in stats]
    low = [m - s["q1"] * scale for m, s in zip(med, stats, strict=True)]
    return med, [low, [s["q3"] * scale - m for m, s in zip(med, stats, strict=True)]]


def context_plot(
    out: Path,
    name: str,
    x: Sequence[int],
    series: dict[str, list[dict[str, float]]],
    trained: int,
    scale: float = 1.0,
    logy: bool = False,
    **labels: str,
) -> str:
    """Each series' medians (times ``scale``) with their IQR against the context lengths ``x``
    on a log-2 axis, the model's ``trained`` context marked; ``labels``: the axes'."""
    fig, [[ax]] = subplots(figsize=(6.4, 4))
    for label, stats in series.items():
        med, err = errorbars(stats, scale)
        ax.errorbar(x, med, yerr=err, marker="o", capsize=3, label=label)
    ax.axvline(trained, color="grey", ls=":", label=f"trained context {trained}")
    ax.set(**labels)
    log2_axis(ax, x, logy=logy)
    ax.legend()
    return save_plot(fig, out, name)


def grouped_bars(
    ax: Any,
    groups: list[str],
    stats: list[dict[str, Any]],
    title: str,
    scale: float = 1.0,
    style: Callable[[str], dict[str, Any]] | None = None,
) -> None:
    """Per group (an x tick), one bar per key of ``stats[group]``: a :func:`summary`'s median
    (times ``scale``) with its IQR, or a plain value; ``style(key)``: the bar's options."""
    keys = list(stats[0])
    width = 0.8 / len(keys)
    for i, key in enumerate(keys):
        values = [s[key] for s in stats]
        med, err = errorbars(values, scale) if isinstance(values[0], dict) else (values, None)
        x = [j + (i - (len(keys) - 1) / 2) * width for j in range(len(groups))]
        ax.bar(x, med, width, yerr=err, capsize=3, label=key, **(style(key) if style else {}))
    ax.set_xticks(range(len(groups)), groups)
    ax.set(title=title)
    ax.legend(fontsize=8)
