"""OpenBLAS from PyPI against the system's: three servers (``QFSERVE_BLAS`` pip, system, pip
again: the A/A pair) get the same streamed chat requests, interleaved; throughput ratios."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import httpx

from bench.harness import interleave, ratios, start, summaries
from bench.report import ratio_cell, section, table
from bench.studies.vs_mlx_lm import chat_arm, per_arm
from qfserve import testing
from qfserve.engine.models.blas import find_blas

ARMS = {"pip_a": "pip", "system": "system", "pip_b": "pip"}  # arm -> QFSERVE_BLAS


def missing() -> str:
    """Why this study cannot run here ("" when it can)."""
    absent = [s for s in ("pip", "system") if find_blas(s) is None]
    return f"no {' and no '.join(absent)} OpenBLAS on this machine" if absent else ""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    run = start(
        "blas", argv, __doc__, reps=5, prompt=(1024, 128, "prompt tokens"), max_tokens=(64, 8)
    )
    if why := missing():
        raise SystemExit(f"blas: {why}")
    args = run.args
    logs = Path(tempfile.mkdtemp(prefix="blas-"))
    libs = {arm: find_blas(source).path for arm, source in ARMS.items()}  # type: ignore[union-attr]
    with contextlib.ExitStack() as stack, httpx.Client() as client:
        arms = {}
        for arm, source in ARMS.items():
            env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}  # each its own
            server = testing.start("qfserve", run.folder, log=logs / f"{arm}.log",
                                   env={**env, "QFSERVE_BLAS": source}, timeout=300)  # fmt: skip
            stack.callback(server.stop, 15)
            arms[arm] = chat_arm(run, client, server.url, args.prompt, model=run.loaded.name,
                                 max_tokens=args.max_tokens)  # fmt: skip
        timings = interleave(arms, args.reps, progress=run.log.rounds("rounds"))
    prefill = {k: [t.prompt_tokens / t.ttft for t in v] for k, v in timings.items()}
    decode = per_arm(timings, "decode_tps")
    named = {arm: libs[arm] in (logs / f"{arm}.log").read_text() for arm in ARMS}
    return run.save({
        "settings": {"reps": args.reps, "prompt_tokens": args.prompt,
                     "max_tokens": args.max_tokens, "temperature": 0, "eos_banned": True,
                     "libraries": libs, "named_in_start_up_log": named},
        "prefill_tps": summaries(prefill),
        "decode_tps": summaries(decode),
        "prefill_ratios": ratios(prefill, "system", ("pip_a", "pip_b")),
        "decode_ratios": ratios(decode, "system", ("pip_a", "pip_b")),
    })  # fmt: skip


def render(d: dict[str, Any]) -> list[str]:
    s = d["settings"]
    intro = (
        f"Streamed chat, {s['prompt_tokens']:,}-token prompts, {s['max_tokens']} tokens, "
        f"greedy, {s['reps']} interleaved rounds. Throughput ratios to `system` (above 1: "
        "faster); `pip_b` is the wheel again (A/A)."
    )
    pre, dec = (
        {r["arm"]: ratio_cell(r) for r in d[k]} for k in ("prefill_ratios", "decode_ratios")
    )
    rows = [[arm, f"{d['prefill_tps'][arm]['median']:.0f}", pre.get(arm, "1"),
             f"{d['decode_tps'][arm]['median']:.1f}", dec.get(arm, "1")] for arm in ARMS]  # fmt: skip
    headers = ["arm", "prefill tok/s", "ratio", "decode tok/s", "ratio"]
    return section("OpenBLAS from PyPI against the system's", d, intro, table(headers, rows))
