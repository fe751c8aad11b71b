"""Every registered study runs with ``--quick`` on the bundled model, writes what its section of
the results page reads, and renders. The sizes are far too small to mean anything: what is
checked is that each study measured what it says, with values in their range."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

from bench.report import render_study
from bench.studies import STUDIES
from tests.bench.conftest import CASES


def _share(x: float | None) -> bool:
    return x is None or 0 <= x <= 1


def _positive_medians(stats: dict[str, dict[str, float]]) -> bool:
    return all(s["median"] > 0 for s in stats.values())


def _ratios(rows: list[dict[str, Any]]) -> bool:
    return all(r["median"] > 0 and r["q1"] <= r["median"] <= r["q3"] for r in rows)


def _room(arm: str, budget: int) -> int:
    """Rows a head may hold beyond the budget: KVzap's decode room where layers share rows."""
    from qfserve.engine.kv.kvzap import decode_room

    return decode_room(budget) if arm.startswith("kvzap/") and arm.endswith("/global") else 0


CHECKS: dict[str, Callable[[dict[str, Any]], bool]] = {
    "perplexity": lambda d: all(
        r["ppl"] > 1 and r["max_rows_any_step"] <= int(b) + _room(arm, int(b))
        for res in d["results"].values()
        for b, arms in res["budgets"].items()
        for arm, r in arms.items()
    ),
    "retrieval": lambda d: all(
        _share(c["accuracy"]) and c["answer_nll_mean"] > 0
        for res in d["results"].values()
        for cells in res["arms"].values()
        for c in cells.values()
    ),
    "niah": lambda d: (
        {r["target_depth"] for r in d["records"]} == set(d["depths"])
        and all(
            _share(v)
            for g in d["grid"].values()
            for rows in g.values()
            for row in rows
            for v in row
        )
    ),
    # Default settings: every row while it fits, the full cache's answers; a small
    # --max-kv-bytes evicts (the longest documents) and says so.
    # Every pair compared on every prompt; a budget above the prompt keeps the full cache's text.
    "llama_parity": lambda d: (
        all(v["of"] == len({r["prompt"] for r in d["rows"]}) for v in d["pairs"].values())
        and all(0 <= v["mean_abs_dlogprob"] < 1 for v in d["pairs"].values())
        and all(k == len({r["prompt"] for r in d["rows"]}) for k in d["methods"].values())
    ),
    # The full arm keeps every byte; each evicting arm a fraction (no sliding layers here).
    "long_context": lambda d: (
        all(c["bytes_ratio"] == 1.0 for c in d["results"]["full"].values())
        and all(
            c["bytes_ratio"] < 0.6 and c["window_mib"] == 0
            for arm, by in d["results"].items()
            if arm != "full"
            for c in by.values()
        )
    ),
    "niah_served": lambda d: (
        all(v["ran"] == ["full"] for v in d["accuracy"]["auto"].values())
        and [v["accuracy"] for v in d["accuracy"]["auto"].values()]
        == [v["accuracy"] for v in d["accuracy"]["full"].values()]
        and any("@" in m for m in d["accuracy"]["auto-small"][str(max(d["lengths"]))]["ran"])
        and all(r["budget_source"] == "auto" for r in d["records"] if r["arm"].startswith("auto"))
        and all(
            v["ran"] == [f"kvzip@{d['small_kvzip_budget']}"]
            for arm in ("kvzip", "kvzip-small")
            for v in d["accuracy"][arm].values()
        )
    ),
    "multiturn_recall": lambda d: (
        set(d["accuracy"]) == set(d["key_nll"])
        and "full/reuse" in d["accuracy"]
        and all(_share(v) for by in d["accuracy"].values() for v in by.values())
    ),
    "kvzip_parity": lambda d: all(_share(v) for by in d["accuracy"].values() for v in by.values()),
    # The same surrogates score the same hidden states alike on both sides, so per head both
    # keep (nearly) the same rows.
    "kvzap_parity": lambda d: (
        all(_share(v) for by in d["accuracy"].values() for v in by.values())
        and d["score_check"]["same_hidden_states"]["max_abs_diff"] < 1e-3
        and d["score_check"]["own_hidden_states"]["spearman_mean"] > 0.99
        and all(
            c["jaccard"] > 0.9 and _share(c["same_answer"])
            for c in d["overlap"]["overlap/per_head~per_head"].values()
        )
    ),
    "kvzip_reuse": lambda d: (
        d["every_later_turn_reused"] is True
        and all(_share(v) for by in d["accuracy"].values() for v in by.values())
    ),
    "decode": lambda d: (
        all(_positive_medians(r["ms_per_step"]) and _ratios(r["ratios"]) for r in d["sweep"])
        and d["kv_bytes_per_token"] > 0
    ),
    "ttft": lambda d: all(
        _positive_medians(r["ttft_s"]) and _ratios(r["ratios"]) for r in d["rows"]
    ),
    "vs_llama_cpp": lambda d: all(
        _positive_medians(r["decode_tps"]) and _ratios(r["tps_ratios"]) for r in d["rows"]
    ),
    "memory": lambda d: (
        len(d["rows"]) >= 2
        and all(r["ours_rss"] > r["weights_bytes"] > 0 and r["theirs_rss"] > 0 for r in d["rows"])
        and all(
            _positive_medians(p["ms"]) and _ratios(list(p["ratios"].values()))
            for p in d["products"]
        )
    ),
    "batching": lambda d: (
        d["complete"] is True and all(_positive_medians(r["tokens_per_s"]) for r in d["rows"])
    ),
    "open_load": lambda d: (
        d["complete"] is True
        and all(r["ours"]["answered"] == r["requests"] > 0 for r in d["rows"])
        and all(r["ours"]["ttft_p95_s"] >= r["ours"]["ttft_p50_s"] > 0 for r in d["rows"])
    ),
    "batch_step": lambda d: all(_ratios(r["ratios"]) for r in d["rows"]),
    "profile": lambda d: (
        all(_positive_medians(v["ms"]) and v["rows"] > 0 for v in d["decode"].values())
        and d["decode"]["qfilters"]["rows"] <= d["settings"]["budget"]
        and _positive_medians(d["prefill_ms"])
    ),
    "kvzip_cost": lambda d: (
        _ratios(d["prefill_ratios"])
        and _ratios(d["decode_ratios"])
        and d["settings"]["kept_rows_after_prefill"]["kvzip"] <= d["settings"]["budget"]
    ),
    "kvzap_cost": lambda d: (
        _ratios(d["prefill_ratios"])
        and _ratios(d["decode_ratios"])
        and {r["arm"] for r in d["decode_ratios"]} == {"qfilters_again", "kvzap", "kvzap_global"}
        and d["settings"]["surrogate"]["bytes"] > 0
    ),
    "kernel_cuda": lambda d: (
        len(d["results"]) > 0
        and all(
            all(r["parity_bitwise"].values())
            and r["score_kernel_allclose"]
            and _positive_medians(r["microseconds"])
            for r in d["results"]
        )
    ),
}


def test_every_mode_of_every_registered_study_has_a_check() -> None:
    assert set(CHECKS) == {f for _, f in CASES}


@pytest.mark.parametrize(("name", "file"), CASES)
def test_study_runs_quick_and_renders(name: str, file: str, quick: Callable, results: Any) -> None:
    data = quick(file)
    s = STUDIES[name]
    assert data["benchmark"] == file and data["section"] == s.section and data["quick"] is True
    assert data["command"].startswith(" ".join(["python -m bench", name, *s.mode(file), "--quick"]))
    if name != "kernel-cuda":  # the kernel alone, on random rows: no model
        assert data["model"]["weights_sha1"] and data["machine"]["cpu_count"] >= 1
    for plot in data.get("plots", []):
        assert (results / plot).stat().st_size > 1000
    assert CHECKS[file](data)
    if hasattr(s.module(file), "render"):
        text = "\n".join(render_study(file, data))
        assert text.startswith("### ") and "Quick" in text


def test_the_command_line_lists_every_study_and_rejects_others() -> None:
    listed = subprocess.run(
        [sys.executable, "-m", "bench", "--list"], capture_output=True, text=True, check=True
    ).stdout
    assert all(f"  {name} " in listed for name in STUDIES)
    # each study with modes lists them after its option, the default first
    assert "--haystack passkey|prose" in listed and "--mode step|batch|profile" in listed
    wrong = subprocess.run(
        [sys.executable, "-m", "bench", "no-such-study"], capture_output=True, text=True
    )
    assert wrong.returncode == 2 and "study must be one of" in wrong.stderr


def test_perplexity_reads_a_prompt_compressed_by_kvzip(results: Any) -> None:
    """``--prompt --kvzip``: the first half is reconstructed and compressed, one sequence at a
    time, then the second half decodes within the budget (on average over layers when they
    share the rows)."""
    from bench.studies.perplexity import main

    data = main(
        [
            "--quick",
            "--prompt",
            "--kvzip",
            "--calibration",
            "fresh",
            "--out",
            str(results / "perplexity-kvzip"),
            "--datasets",
            "stdlib",
            "--only",
            "qfilters/r25",
            "kvzip/r25",
            "kvzip/r25/global",
        ]
    )
    budgets = data["results"]["stdlib"]["budgets"]
    assert {a for arms in budgets.values() for a in arms} >= {"kvzip/r25", "kvzip/r25/global"}
    for b, arms in budgets.items():
        for r in arms.values():
            assert r["ppl"] > 1 and r["max_rows_any_step"] <= int(b)
