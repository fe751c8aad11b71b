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
