"""Smoke test of the speed studies (bench/speed): each runs in --quick mode on the bundled
qfserve-tiny and writes its JSON and plots. Seconds, not a measurement."""

from __future__ import annotations

import importlib
import json

import pytest

STUDIES = (
    "decode",
    "ttft",
    "server_overhead",
    "vs_mlx_lm",
    "bandwidth",
    "batching",
    "multiturn",
    "batch_step",
    "selfcal_prefill",
    "refine_step",
)


@pytest.mark.parametrize("study", STUDIES)
def test_study_quick(study, tmp_path):
    module = importlib.import_module(f"bench.speed.{study}")
    result = module.main(["--quick", "--model", "qfserve-tiny", "--out", str(tmp_path)])
    written = json.loads((tmp_path / f"{study}.json").read_text())
    assert written["benchmark"] == study
    assert written["quick"] is True
    assert written["machine"]["cpu_count"] >= 1
    for name in result["plots"]:
        assert (tmp_path / name).stat().st_size > 0


def test_structured_overhead_study_runs(tmp_path):
    from bench.speed import structured

    assert structured.main(["--quick", "--model", "qfserve-tiny", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "structured.json").read_text())
    assert data["ratios"]["schema/free"]["median"] > 0
    assert 0 < data["processor_ms_per_token"]["median"] < data["ms_per_token"]["schema"]["median"]


def test_ttft_keeps_earlier_rows_of_the_same_settings(tmp_path):
    """A run at one prompt length keeps the other lengths an earlier full run measured on
    the same weights and settings, and replaces its own; other settings start afresh."""
    from bench.harness import machine
    from bench.speed.ttft import earlier_rows

    here = {**machine(), "load_average": [9.0, 9.0, 9.0]}  # the load may differ

    def run(prompts, reps=2, sha="abc", quick=False, cores=here["cpu_count"]):
        rows = [{"prompt_tokens": n, "ttft_s": {"full_a": n}} for n in prompts]
        return {"quick": quick, "settings": {"reps": reps}, "rows": rows,
                "model": {"weights_sha1": sha, "path": "/m"}, "machine": {**here, "cpu_count": cores},
                "command": f"ttft {prompts}", "when": "2026-12-01T00:00:00"}  # fmt: skip

    path = tmp_path / "ttft.json"
    path.write_text(json.dumps(run([1024, 2048])))
    kept = earlier_rows(path, run([2048, 4096]), {2048, 4096})
    assert [r["prompt_tokens"] for r in kept] == [1024]
    assert kept[0]["measured_by"] == {"command": "ttft [1024, 2048]", "when": "2026-12-01"}
    assert earlier_rows(path, run([4096], reps=3), {4096}) == []
    assert earlier_rows(path, run([4096], sha="other"), {4096}) == []
    assert earlier_rows(path, run([4096], quick=True), {4096}) == []
    path.write_text(json.dumps(run([1024, 2048], cores=999)))  # another machine's rows
    assert earlier_rows(path, run([4096]), {4096}) == []
    assert earlier_rows(tmp_path / "missing.json", run([4096]), {4096}) == []
