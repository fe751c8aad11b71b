"""The goals table says met only when the figures a study wrote meet every number it names."""

from __future__ import annotations

import json
from pathlib import Path

from bench.goals import batching, decode, render_goals, retrieval


def _write(folder: Path, name: str, data: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{name}.json").write_text(json.dumps(data))


def _cell(acc: float, n: int = 6) -> dict:
    return {"accuracy": acc, "n": n}


def test_retrieval_goal_pools_4k_and_8k_and_requires_beating_baselines(tmp_path: Path) -> None:
    def arms(q: list[float], k: list[float]) -> dict:
        ratios = (8, 16, 32)
        return {
            "arms": {
                "qfilters/r25": {str(r): _cell(a) for r, a in zip(ratios, q, strict=True)},
                "knorm/r25": {str(r): _cell(a) for r, a in zip(ratios, k, strict=True)},
                "streaming/r0": {str(r): _cell(0.0) for r in ratios},
            }
        }

    good = arms([1.0, 1.0, 1.0], [0.5, 0.5, 0.5])
    _write(
        tmp_path,
        "retrieval",
        {
            "ratios": [8, 16, 32],
            "results": {"1024": arms([0.0] * 3, [1.0] * 3), "4096": good, "8192": good},
        },
    )
    goal, measured, verdict = retrieval(tmp_path)
    assert verdict == "**met**"  # the 1k documents are not part of the goal
    assert "8×: 1.00 (K-norm 0.50, streaming 0.00)" in measured
    tied = arms([1.0, 0.83, 1.0], [0.5, 0.83, 0.5])
    _write(tmp_path, "retrieval", {"ratios": [8, 16, 32], "results": {"4096": tied}})
    assert retrieval(tmp_path)[2] == "**not met**"  # 16x: below 90% and tied with K-norm


def test_decode_goal_reads_the_longest_context(tmp_path: Path) -> None:
    def mem(context: int, arm: str, peak: int) -> dict:
        return {
            "context": context,
            "arm": arm,
            "prefill_peak_bytes": peak,
            "decode_peak_bytes": peak // 2,
        }

    sweep = [
        {
            "context": c,
            "ratios": [{"arm": "full_b", "median": 1.0}, {"arm": "b512", "median": ratio}],
        }
        for c, ratio in ((1024, 0.9), (8192, 0.4))
    ]
    memory = [
        mem(1024, "b512", 100),
        mem(8192, "b512", 110),
        mem(1024, "full", 100),
        mem(8192, "full", 800),
    ]
    _write(tmp_path, "decode", {"sweep": sweep, "memory": memory})
    goal, measured, verdict = decode(tmp_path)
    assert verdict == "**met**" and "at 8192: 2.50×" in measured
    assert "full cache 8.00×" in measured


def test_missing_studies_say_not_run(tmp_path: Path) -> None:
    _write(tmp_path, "structured", {})
    lines = render_goals(tmp_path)
    assert lines and all(
        line.endswith("| not run |")
        for line in lines
        if line.startswith("| ") and "goal" not in line
    )
    assert render_goals(tmp_path / "nothing") == []


def test_batching_goal_is_8_streams_over_one_and_over_llama_server(tmp_path: Path) -> None:
    def row(streams: int, ours: float) -> dict:
        return {
            "prompt_tokens": 256,
            "streams": streams,
            "tokens_per_s": {"batched_a": {"median": ours}},
        }

    def run(speedup: float, over: float, sixteen: float, arms=("batched_a", "llama")) -> tuple:
        _write(
            tmp_path,
            "batching",
            {
                "settings": {"arms": list(arms)},
                "rows": [row(1, 5.0), row(8, 5 * speedup), row(16, 5 * speedup * sixteen)],
                "speedup_over_one_stream": {"256": {"1": 1.0, "8": speedup}},
                "over_llama": {"256": {"8": over}},
            },
        )
        return batching(tmp_path)[1:]

    assert run(3.2, 1.3, 1.0)[1] == "**met**"
    assert run(3.2, 1.1, 1.0)[1] == "**not met**"  # under 1.2x llama-server's
    assert run(2.5, 1.3, 1.0)[1] == "**not met**"  # under 3x one stream
    assert run(3.2, 1.3, 0.9)[1] == "**not met**"  # 16 streams below 8
    measured, _ = run(3.2, 1.3, 1.0)
    assert "3.20× one stream" in measured and "1.30× llama-server's" in measured
    assert run(3.2, 1.3, 1.0, arms=("batched_a",))[1] == "not run"  # no reference, no verdict
