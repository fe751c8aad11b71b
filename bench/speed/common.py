"""What the speed studies share beyond :mod:`bench.cli`, :mod:`bench.models`,
:mod:`bench.harness` and :mod:`qfserve.testing`: model and prompts, caches per arm, progress,
plots, and timed streaming requests.

Every entry point calls :func:`qfserve.engine.models.blas.reexec_with_openblas` before importing this module
(it imports MLX).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

with contextlib.suppress(ImportError):  # quiet "sequence longer than the model" warnings
    import transformers

    transformers.logging.set_verbosity_error()

from bench.models import BenchModel, load
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.factory import make_caches

REPO = Path(__file__).resolve().parents[2]


# -- progress and plots --------------------------------------------------------------------


class Progress:
    """One line per step on stderr, with the elapsed time: ``[decode 12.3s] context 1024``."""

    def __init__(self, study: str) -> None:
        self.study = study
        self.start = time.perf_counter()

    def __call__(self, message: str) -> None:
        elapsed = time.perf_counter() - self.start
        print(f"[{self.study} {elapsed:6.1f}s] {message}", file=sys.stderr, flush=True)

    def rounds(self, label: str):
        """A callback for :func:`bench.harness.interleave`."""
        return lambda done, total: self(f"{label}: round {done}/{total}")

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.start


def plt():
    """matplotlib.pyplot on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def save_figure(fig, out: Path, name: str) -> str:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt().close(fig)
    return path.name


def log2_axis(ax, ticks: Sequence[int], *, logy: bool = False) -> None:
    """Log-2 x axis labelled only at ``ticks`` (no minor-tick clutter); optionally log y."""
    from matplotlib.ticker import NullLocator, ScalarFormatter

    ax.set_xscale("log", base=2)
    ax.set_xticks(list(ticks), [str(t) for t in ticks])
    ax.xaxis.set_minor_locator(NullLocator())
    if logy:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(ScalarFormatter())
        ax.yaxis.set_minor_formatter(ScalarFormatter())


def errorbars(stats: Sequence[dict[str, float]]) -> tuple[list[float], list[list[float]]]:
    """Medians and the interquartile range as matplotlib's asymmetric ``yerr``."""
    med = [s["median"] for s in stats]
    return med, [
        [m - s["q1"] for m, s in zip(med, stats, strict=True)],
        [s["q3"] - m for m, s in zip(med, stats, strict=True)],
    ]


# -- model, prompts, caches -----------------------------------------------------------------


@dataclass(frozen=True)
class StudyModel:
    """The measured model (:class:`bench.models.BenchModel`) and the filters the server
    would use for it (the registry's calibrated ones, else the key-SVD fallback)."""

    bench: BenchModel
    filters: Any
    filter_source: str

    @property
    def loaded(self) -> Any:
        return self.bench.loaded

    @property
    def path(self) -> Path:
        """The folder servers started by a study load (a GGUF's converted folder)."""
        return self.bench.folder

    @property
    def context_length(self) -> int:
        return self.bench.context_length

    def describe(self) -> dict[str, Any]:
        return {**self.bench.identity, "filter_source": self.filter_source}


def load_study_model(ref: str) -> StudyModel:
    """Load through the server's loader, with the filters the server would use."""
    from qfserve.calibrations.model_info import model_fingerprint
    from qfserve.engine.filters.artifact import resolve_filters

    bm = load(ref)
    filters, source = resolve_filters(
        bm.model, bm.loaded.model_id, fingerprint=model_fingerprint(bm.model, bm.loaded.config)
    )
    return StudyModel(bm, filters, source)


def cache_config(arm: str | int) -> CacheConfig:
    """``"full"`` or a budget: Q-Filters with the server's defaults (n_sink 4, recent 0)."""
    if arm == "full":
        return CacheConfig(method="full")
    return CacheConfig(method="qfilters", budget=int(arm))


def caches_for(sm: StudyModel, arm: str | int) -> list[Any]:
    config = cache_config(arm)
    return make_caches(sm.loaded.model, config, filters=sm.filters if config.evicts else None)


_TEXT: str | None = None


def corpus_text() -> str:
    """Real text that exists offline and is fixed for a Python version: stdlib sources."""
    global _TEXT
    if _TEXT is None:
        import argparse as a
        import inspect
        import typing as t

        _TEXT = "\n".join(inspect.getsource(m) for m in (a, t, inspect))
    return _TEXT


_IDS: dict[int, list[int]] = {}


def prompt_tokens(sm: StudyModel, n: int) -> list[int]:
    """The first ``n`` tokens of :func:`corpus_text` (repeated if it is too short)."""
    tok = sm.loaded.tokenizer
    if id(tok) not in _IDS:
        # Encoded in pieces: one long call makes transformers warn about the model's length.
        text = corpus_text()
        _IDS[id(tok)] = [
            t
            for i in range(0, len(text), 4000)
            for t in tok.encode(text[i : i + 4000], add_special_tokens=False)
        ]
    ids = _IDS[id(tok)]
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def chat_content(sm: StudyModel, n_tokens: int, nonce: str = "") -> str:
    """User content whose chat-templated prompt is about ``n_tokens`` long."""
    tok = sm.loaded.tokenizer
    overhead = len(
        tok.apply_chat_template([{"role": "user", "content": nonce}], add_generation_prompt=True)
    )
    body = tok.decode(prompt_tokens(sm, max(1, n_tokens - overhead)))
    return nonce + body


def eos_ban(sm: StudyModel) -> dict[str, float]:
    """``logit_bias`` that bans every end-of-sequence token, so each run makes max_tokens."""
    return {str(t): -100.0 for t in sorted(sm.loaded.tokenizer.eos_token_ids)}


def prefill(model, caches: list[Any], tokens: Sequence[int], chunk: int = 512) -> None:
    """Run ``tokens`` through the model in chunks (no sampling), filling ``caches``."""
    ids = mx.array(list(tokens))
    for s in range(0, len(tokens), chunk):
        model(ids[None, s : s + chunk], cache=caches)
        mx.eval([c.state for c in caches])


def kv_stats(caches: list[Any]) -> dict[str, int]:
    """Kept rows and bytes (statistics) and the bytes the cache arrays really hold."""
    from qfserve.engine.kv.stats import summarize

    s = summarize(caches)
    return {
        "tokens_seen": s.tokens_seen,
        "tokens_kept": s.tokens_kept,
        "kept_bytes": s.kept_bytes,
        "full_seq_bytes": s.full_seq_bytes,
        "cache_nbytes": sum(c.nbytes for c in caches),
    }


def decode_timer(model, caches: list[Any], steps: int, *, hold: bool):
    """A callable timing ``steps`` single-token decode steps; returns ms/step.

    ``hold`` trims every trimmable cache back by one row after each step, so a full cache
    (and an eviction cache that has not evicted yet) stays at its context length.
    """
    token = mx.array([[17]])

    def run() -> float:
        tic = time.perf_counter()
        for _ in range(steps):
            logits = model(token, cache=caches)
            mx.eval(logits, [c.state for c in caches])
            if hold:
                for c in caches:
                    if c.is_trimmable():
                        c.trim(1)
        return (time.perf_counter() - tic) / steps * 1e3

    return run


# -- HTTP side ------------------------------------------------------------------------------


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


def stream_chat(client, url: str, body: dict[str, Any]) -> StreamTiming:
    """POST a streamed ``/v1/chat/completions`` request and time its chunks."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    ttft = None
    chunks = 0
    times: list[float] = []
    usage: dict[str, Any] = {}
    kv = None
    tic = time.perf_counter()
    with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:500]}")
        for line in r.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"{url}: stream error: {event['error']}")
            for choice in event.get("choices") or ():
                if (choice.get("delta") or {}).get("content"):
                    chunks += 1
                    times.append(time.perf_counter() - tic)
                    if ttft is None:
                        ttft = times[-1]
            usage = event.get("usage") or usage
            kv = event.get("kv_cache") or kv
    total = time.perf_counter() - tic
    if ttft is None:
        raise RuntimeError(f"{url}: the stream carried no text")
    return StreamTiming(
        ttft=ttft,
        total=total,
        completion_tokens=int(usage.get("completion_tokens", chunks)),
        prompt_tokens=int(usage.get("prompt_tokens", 0)),
        chunks=chunks,
        kv_cache=kv,
        chunk_times=tuple(times),
    )
