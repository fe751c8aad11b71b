"""Q-Filters learned from traffic, as a server without an artifact learns them.

The server's pooling fed held-out ``chat`` or ``passkey`` traffic until it writes its artifact
(for ``--traffic-artifacts``); the learned filters against the calibrated ones.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import make_prompt_cache

from bench.data import passkey_docs, prose_windows, stdlib_windows
from bench.plots import save_plot, subplots
from bench.report import fmt, pct, section, table
from bench.run import start
from qfserve.calibrations.artifact import read_calibration
from qfserve.engine.filters.traffic import DEFAULT_MIN_PROMPTS, TrafficCalibration
from qfserve.engine.kv.selfcal import install_query_taps, remove_query_taps

STUDY = "traffic"
CHUNK = 512  # the server's prefill chunk (qfserve.engine.serving.config.DEFAULT_PREFILL_CHUNK)
INSTRUCTIONS = (
    "Explain what the following does.",
    "Summarise this in three sentences.",
    "Find the bugs in this, if any.",
    "Translate this into plain English for a beginner.",
)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per (layer, KV head) cosine of two unit filter sets ``(n_layers, n_kv, D)``."""
    return np.einsum("lkd,lkd->lk", a.astype(np.float64), b.astype(np.float64))


def chat_traffic(study: Any, n: int, lengths: tuple[int, ...]) -> list[list[int]]:
    """``n`` chat-templated requests on held-out code and prose windows of ``lengths``."""
    tok, corpus = study.tokenizer, study.corpus
    windows = {  # (code?, length) -> n windows of that kind, spread over the held-out text
        (code, length): stdlib_windows(corpus, length, n) if code else prose_windows(tok, length, n)
        for code in (True, False)
        for length in lengths
    }
    out = []
    for i in range(n):
        source = windows[(i % 2 == 0, lengths[i % len(lengths)])]
        text = tok.decode(source[i].tolist())
        messages = [{"role": "user", "content": f"{INSTRUCTIONS[i % len(INSTRUCTIONS)]}\n\n{text}"}]
        out.append(list(tok.apply_chat_template(messages, add_generation_prompt=True)))
    return out


def passkey_traffic(study: Any, n: int, length: int) -> list[list[int]]:
    """``n`` pass-key documents of ``length`` tokens (768 in full runs: not a length the
    retrieval study measures)."""
    docs = passkey_docs(study.corpus, length, -(-n // 3))
    if not docs:
        raise ValueError(f"the pass-key generator made no {length}-token documents")
    return [d["prompt"] for d in docs][:n]


def serve(model: Any, prompts: list[list[int]], pool: TrafficCalibration) -> tuple[Path, dict]:
    """Prefill ``prompts`` in the server's chunks, flushing ``pool`` after each, until it
    writes its artifact; its path and what it took."""
    started, fed = time.perf_counter(), 0
    for n, prompt in enumerate(prompts, 1):
        cache = make_prompt_cache(model)
        for at in range(0, len(prompt), CHUNK):
            model(mx.array(prompt[at : at + CHUNK])[None], cache=cache)
            mx.eval([c.state for c in cache])
            fed += len(prompt[at : at + CHUNK])
            path = pool.flush()
            if path is not None:
                return path, {
                    "prompts": n,
                    "tokens": fed,
                    "seconds": round(time.perf_counter() - started, 1),
                }
    raise RuntimeError(
        f"{len(prompts)} prompts ({fed} tokens) were not enough to write an artifact "
        f"({pool.prompts} prompts counted, {pool.tokens_seen} tokens pooled per layer)"
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    kinds = {"nargs": "+", "default": ["chat", "passkey"], "choices": ("chat", "passkey")}
    study = start(
        STUDY,
        argv,
        __doc__,
        calibration=True,
        flags={"--traffic": kinds},
        max_prompts=(64, 6, "traffic offered at most"),
        min_prompts=(DEFAULT_MIN_PROMPTS, 3, "prompts pooled at least"),
    )
    args = study.args
    quick, max_prompts = args.quick, args.max_prompts
    model, identity, calibrated = study.model, study.identity, np.asarray(study.filters)
    makers = {
        "chat": lambda: chat_traffic(study, max_prompts, (128,) if quick else (256, 512, 1024)),
        "passkey": lambda: passkey_traffic(study, max_prompts, 320 if quick else 768),
    }
    samples = {"samples_per_head": 200} if quick else {}  # else calibration's default
    results: dict[str, Any] = {}
    for kind in args.traffic:
        prompts = makers[kind]()
        pool = TrafficCalibration(
            install_query_taps(model),
            n_kv_heads=identity["n_kv_heads"],
            model_id=identity["model_id"],
            fingerprint=identity["fingerprint"],
            out_dir=args.out / kind,
            min_prompts=args.min_prompts,
            **samples,
        )
        try:
            path, took = serve(model, prompts, pool)
        finally:
            remove_query_taps(model)
        learned = read_calibration(path)
        cos = cosines(learned.filters, calibrated)  # [layer][kv head], to the calibrated filter
        results[kind] = {
            **took,
            "artifact": str(path.relative_to(args.out)),
            "artifact_text": learned.metadata.get("text"),
            "samples_per_head": learned.metadata.get("samples_per_head"),
            "cosine_mean": float(cos.mean()),
            "cosine_min": float(cos.min()),
            "same_sign_share": float((cos > 0).mean()),
            "cosine": cos.tolist(),
        }
    data = {
        "chat": "chat-templated requests: an instruction, then an evaluation-split stdlib "
        "window or a stdlib docstring-prose window of 256/512/1024 tokens in turn",
        "passkey": "retrieval's pass-key generator at 768 tokens (evaluation seeds)",
        "prefill_chunk": CHUNK,
        "min_prompts": args.min_prompts,
    }
    plot_name = plot(results, args.out, identity["checkpoint"])
    return study.save({"data": data, "results": results, "plots": [plot_name]})


def plot(results: dict[str, Any], out: Path, checkpoint: str) -> str:
    """Per traffic kind, each KV head's cosine to the calibrated filter along the layers."""
    fig, ax = subplots(1, len(results), figsize=(4.2 * len(results), 3.6))
    for a, (kind, r) in zip(ax[0], results.items(), strict=True):
        cos = np.asarray(r["cosine"])
        for k in range(cos.shape[1]):
            a.plot(range(cos.shape[0]), cos[:, k], marker="o", ms=3, label=f"KV head {k}")
        a.axhline(0, color="grey", lw=0.5)
        a.set(ylim=(-1.05, 1.05), xlabel="layer")
        a.set_title(f"{kind}: {r['prompts']} prompts, {r['tokens']} tokens", fontsize=9)
    ax[0, 0].set_ylabel("cosine to the calibrated filter")
    ax[0, 0].legend(fontsize=7)
    return save_plot(fig, out, STUDY, f"{checkpoint}: filters learned from traffic")


def render(data: dict[str, Any]) -> list[str]:
    d = data["data"]
    intro = (
        "The server's own pooling (`qfserve.engine.filters.traffic`) fed held-out traffic in "
        f"{d['prefill_chunk']}-token prefill chunks until it wrote its artifact; the learned "
        "filters against the registry's calibrated ones (cosine per layer and KV head). "
        f"`chat`: {d['chat']}; `passkey`: {d['passkey']}."
    )
    rows = [
        [
            kind,
            r["prompts"],
            r["tokens"],
            r["seconds"],
            fmt(r["cosine_mean"]),
            fmt(r["cosine_min"]),
            pct(r["same_sign_share"]),
            r["artifact"],
        ]
        for kind, r in data["results"].items()
    ]
    headers = ["traffic", "prompts", "tokens", "s", "mean cosine", "min cosine", "same sign"]
    return section(
        "Q-Filters learned from traffic", data, intro, table([*headers, "artifact"], rows)
    )
