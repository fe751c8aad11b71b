"""The ttft study keeps earlier rows of the same settings beside a new run's."""

from __future__ import annotations

import json


def test_ttft_keeps_earlier_rows_of_the_same_settings(tmp_path):
    """A run at one prompt length keeps the other lengths an earlier full run measured on
    the same weights and settings, and replaces its own; other settings start afresh."""
    from bench.run import machine
    from bench.studies.prefill_cost.ttft import earlier_rows

    here = {**machine(), "load_average": [9.0, 9.0, 9.0]}  # the load may differ

    def run(prompts, reps=2, sha="abc", quick=False, cores=here["cpu_count"]):
        rows = [{"prompt_tokens": n, "ttft_s": {"full_a": n}} for n in prompts]
        return {
            "quick": quick,
            "settings": {"reps": reps},
            "rows": rows,
            "model": {"weights_sha1": sha, "path": "/m"},
            "machine": {**here, "cpu_count": cores},
            "command": f"ttft {prompts}",
            "when": "2026-12-01T00:00:00",
        }

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
