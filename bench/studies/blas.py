"""OpenBLAS from PyPI against the system's, side by side.

Three servers (``QFSERVE_BLAS`` pip, system, pip again: the A/A pair) get the same streamed
chat requests, interleaved; prefill and decode throughput as ratios to the system's.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

import httpx

from bench.harness import interleave, open_run, parse, parser, ratios, summaries
from bench.report import ratio_cell, speed_header, table
from bench.studies.vs_mlx_lm import chat_arm, per_arm
from qfserve import testing
from qfserve.engine.models.blas import find_blas

ARMS = {"pip_a": "pip", "system": "system", "pip_b": "pip"}  # arm -> QFSERVE_BLAS


def missing() -> str:
    """Why this study cannot run here ("" when it can)."""
    absent = [s for s in ("pip", "system") if find_blas(s) is None]
    return f"no {' and no '.join(absent)} OpenBLAS on this machine" if absent else ""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = parser(__doc__, reps=5, prompt=(1024, 128, "prompt tokens"), max_tokens=(64, 8))
    args = parse(p, argv)
    if why := missing():
        raise SystemExit(f"blas: {why}")
    run = open_run("blas", args, argv)
    logs = Path(tempfile.mkdtemp(prefix="blas-"))
    libs = {arm: find_blas(source).path for arm, source in ARMS.items()}  # type: ignore[union-attr]
    with contextlib.ExitStack() as stack:
        urls = {}
        for arm, source in ARMS.items():
            env = {**os.environ, "QFSERVE_BLAS": source}
            env.pop("LD_PRELOAD", None)  # each server preloads its own
            server = testing.start("qfserve", run.folder, log=logs / f"{arm}.log", env=env,
                                   timeout=300)  # fmt: skip
            stack.callback(server.stop, 15)
            urls[arm] = server.url
        client = stack.enter_context(httpx.Client())
        body = {"model": run.loaded.name, "max_tokens": args.max_tokens}
        arms = {arm: chat_arm(run, client, url, args.prompt, **body) for arm, url in urls.items()}
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
    """This study's section of ``bench/RESULTS.md``."""
    s = d["settings"]
    lines = speed_header("OpenBLAS from PyPI against the system's", d)
    lines += [f"Streamed chat, {s['prompt_tokens']:,}-token prompts, {s['max_tokens']} tokens, "
              f"greedy, {s['reps']} interleaved rounds. Throughput ratios to `system` (above 1: "
              "faster); `pip_b` is the wheel again (A/A).", ""]  # fmt: skip
    pre = {r["arm"]: r for r in d["prefill_ratios"]}
    dec = {r["arm"]: r for r in d["decode_ratios"]}
    rows = [[arm, f"{d['prefill_tps'][arm]['median']:.0f}", ratio_cell(pre[arm]) if arm in pre else "1",
             f"{d['decode_tps'][arm]['median']:.1f}", ratio_cell(dec[arm]) if arm in dec else "1"]
            for arm in ARMS]  # fmt: skip
    return lines + table(["arm", "prefill tok/s", "ratio", "decode tok/s", "ratio"], rows)
