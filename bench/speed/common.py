"""Plumbing shared by the speed studies: model and prompts, caches per arm, progress, tables,
plots, and the HTTP side (servers on ephemeral loopback ports, timed streaming requests).

Every entry point calls :func:`engine.blas.reexec_with_openblas` before importing this module
(it imports MLX).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx

with contextlib.suppress(ImportError):  # quiet "sequence longer than the model" warnings
    import transformers

    transformers.logging.set_verbosity_error()

from bench.harness import RESULTS_DIR
from engine.config import CacheConfig
from engine.factory import make_caches
from engine.loading import LoadedModel, default_model_path, load_model

REPO = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"  # loopback only, always
TINY = "tiny"  # --model value for the random-weight test model (tests/tiny.py)


# -- arguments, progress, output -----------------------------------------------------------


def make_parser(description: str, *, reps: int) -> argparse.ArgumentParser:
    """The arguments every study takes: ``--quick``, ``--model``, ``--reps``, ``--out``."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="CI-sized run (seconds, not minutes)")
    p.add_argument(
        "--model",
        default=None,
        help=f"GGUF file, model folder or catalog name (default: the bundled "
        f"{default_model_path().name}); "
        f"'{TINY}' builds the random-weight test model",
    )
    p.add_argument(
        "--reps",
        type=int,
        default=None,
        help=f"timed repetitions per arm (default: {reps}; quick: 2)",
    )
    p.add_argument("--out", type=Path, default=RESULTS_DIR, help="folder for JSON and PNG files")
    p.set_defaults(default_reps=reps)
    return p


def command_line(study: str, argv: Sequence[str] | None) -> str:
    """The command that reproduces this run, with the arguments it was given."""
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(["python -m bench.speed." + study, *args])


def reps_of(args: argparse.Namespace) -> int:
    if args.reps is not None:
        if args.reps < 1:
            raise ValueError(f"--reps must be >= 1, got {args.reps}")
        return args.reps
    return 2 if args.quick else args.default_reps


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


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """A plain fixed-width table on stdout."""
    cells = [[_fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"
    return str(value)


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
    """The loaded model, the folder it came from (servers load the same folder), filters."""

    loaded: LoadedModel
    path: Path
    filters: Any
    filter_source: str

    @property
    def context_length(self) -> int:
        return self.loaded.context_length

    def describe(self) -> dict[str, Any]:
        args = self.loaded.model.args
        return {
            "name": self.loaded.name,
            "path": str(self.path.relative_to(REPO)) if self.path.is_relative_to(REPO) else "tiny",
            "layers": args.num_hidden_layers,
            "hidden_size": args.hidden_size,
            "q_heads": args.num_attention_heads,
            "kv_heads": args.num_key_value_heads,
            "head_dim": self.loaded.model.layers[0].self_attn.head_dim,
            "context_length": self.context_length,
            "weight_bytes": weight_bytes(self.loaded.model),
            "filter_source": self.filter_source,
        }


_TINY_DIR: Path | None = None


def model_path(ref: str | None) -> Path:
    """``None``: the bundled model; ``tiny``: the test model saved once to a temp folder."""
    global _TINY_DIR
    if ref == TINY:
        if _TINY_DIR is None:
            from tests.tiny import save_tiny_model

            _TINY_DIR = save_tiny_model(Path(tempfile.mkdtemp(prefix="qfserve-tiny-")) / "tiny")
        return _TINY_DIR
    if not ref:
        return default_model_path()
    from engine.loading import resolve_model_ref

    return Path(resolve_model_ref(ref))  # a GGUF file or catalog name: its converted folder


def load_study_model(ref: str | None) -> StudyModel:
    """Load through the engine's own loader, with the filters the server would use."""
    path = model_path(ref)
    loaded = load_model(str(path))
    try:
        from calibrations.model_info import model_fingerprint
        from engine.filters import resolve_filters

        filters, source = resolve_filters(
            loaded.model,
            loaded.model_id,
            fingerprint=model_fingerprint(loaded.model, loaded.config),
        )
    except ImportError:
        filters, source = None, "fallback"
    return StudyModel(loaded, path, filters, source)


def weight_bytes(model) -> int:
    from mlx.utils import tree_flatten

    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


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
    from engine.stats import summarize

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


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _env() -> dict[str, str]:
    # Both servers get OpenBLAS preloaded, as qfserve arranges for itself; mlx_lm.server
    # would otherwise run float32 matmul on MLX's reference BLAS (~30x slower).
    from engine.blas import find_openblas

    env = dict(os.environ)
    lib = find_openblas()
    if lib and lib not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
    env["PYTHONPATH"] = ":".join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    return env


def _command(kind: str, model: Path, port: int) -> tuple[list[str], str]:
    if kind == "qfserve":
        cmd = ["-m", "server.cli", "--model", str(model), "--log-level", "warning"]
        health = "/health"
    elif kind == "mlx_lm":
        cmd = ["-m", "mlx_lm.server", "--model", str(model), "--log-level", "WARNING"]
        health = "/v1/models"
    else:
        raise ValueError(f"kind must be 'qfserve' or 'mlx_lm', got {kind!r}")
    return [sys.executable, *cmd, "--host", HOST, "--port", str(port)], health


@contextlib.contextmanager
def serve(*kinds: str, model: Path, timeout: float = 120.0) -> Iterator[list[str]]:
    """Start servers (``qfserve`` and/or ``mlx_lm``) on ephemeral loopback ports, together.

    Yields their base URLs, in the order of ``kinds``, once every one answers its health
    route; stops them all on exit.
    """
    import httpx

    procs = []
    try:
        for kind in kinds:
            port = free_port()
            cmd, health = _command(kind, model, port)
            # Kept open until the server stops; closed and removed in the finally below.
            log = tempfile.NamedTemporaryFile(  # noqa: SIM115
                prefix=f"{kind}-", suffix=".log", delete=False
            )
            proc = subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=log, stderr=subprocess.STDOUT)
            procs.append((kind, proc, log, f"http://{HOST}:{port}", health))
        deadline = time.monotonic() + timeout
        for kind, proc, log, url, health in procs:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{kind} exited ({proc.returncode}): {_tail(log.name)}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(url + health, timeout=2.0).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{kind} not ready after {timeout}s: {_tail(log.name)}")
                time.sleep(0.2)
        yield [url for _, _, _, url, _ in procs]
    finally:
        for _, proc, _log, _, _ in procs:
            proc.terminate()
        for _, proc, log, _, _ in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
            os.unlink(log.name)


def _tail(path: str, n: int = 2000) -> str:
    return Path(path).read_text(errors="replace")[-n:]


@dataclass(frozen=True)
class StreamTiming:
    """One streamed request, timed on the client: seconds, from sending the request."""

    ttft: float  # first chunk with non-empty text
    total: float  # stream finished
    completion_tokens: int
    prompt_tokens: int
    chunks: int
    kv_cache: dict[str, Any] | None = None

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
                    if ttft is None:
                        ttft = time.perf_counter() - tic
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
    )
