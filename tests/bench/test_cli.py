"""The command line every study shares: defaults that depend on other arguments."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from bench.cli import RESULTS_DIR, command_line, parse, parser, results_dir


def test_the_default_model_is_the_served_one_and_quick_runs_the_bundled_one():
    p = parser("x", reps=5, calibration=True)
    args = parse(p, [])
    assert (args.model, args.out, args.reps) == (
        "smollm2-135m-instruct",
        RESULTS_DIR / "smollm2",
        5,
    )
    assert args.calibration == "auto"
    quick = parse(p, ["--quick"])
    assert (quick.model, quick.out, quick.reps) == ("qfserve-tiny", RESULTS_DIR / "qfserve-tiny", 2)
    mine = parse(p, ["--model", "/models/My-Model.Q4_0.gguf", "--out", "/tmp/r", "--reps", "3"])
    assert (mine.out, mine.reps) == (Path("/tmp/r"), 3)


def test_results_go_to_a_folder_named_after_the_model():
    assert results_dir("/m/SmolLM2-360M.Q8_0.gguf") == RESULTS_DIR / "SmolLM2-360M.Q8_0"
    assert results_dir("/models/qwen2-0.5b/") == RESULTS_DIR / "qwen2-0.5b"
    assert (
        results_dir("HuggingFaceTB/SmolLM2-1.7B-Instruct") == RESULTS_DIR / "SmolLM2-1.7B-Instruct"
    )


def test_bad_reps_are_an_argument_error(capsys):
    with pytest.raises(SystemExit):
        parse(parser("x", reps=5), ["--reps", "0"])
    assert "--reps must be >= 1" in capsys.readouterr().err


def test_studies_without_reps_or_calibration_do_not_take_them():
    with pytest.raises(SystemExit):
        parse(parser("x"), ["--reps", "3"])
    with pytest.raises(SystemExit):
        parse(parser("x"), ["--calibration", "fresh"])


def test_the_command_line_reproduces_the_run_mode_included():
    assert command_line("kvzip_cost", ["--quick", "--reps", "2"]) == (
        "python -m bench prefill-cost --mode kvzip --quick --reps 2"
    )
    assert command_line("niah", ["--haystack", "prose", "--quick"]) == (
        "python -m bench retrieval --haystack prose --quick"
    )
    assert command_line("long_context", ["--quick"]) == "python -m bench long-context --quick"


def test_every_result_file_has_one_study_and_its_mode_picks_it():
    """Each JSON file a mode writes belongs to one study, whose option picks that mode's
    module (default: the first), and the module measures and renders it."""
    from bench.studies import STUDIES, owner, study

    files = [f for s in STUDIES.values() for f in s.files]
    assert len(files) == len(set(files)) and len(STUDIES) <= 17
    for f in files:
        s = owner(f)
        assert s.file_for(s.mode(f)) == f and s.file_for(["--quick"]) == s.files[0]
        module = s.module(f)
        assert callable(module.main), f
        # every mode renders its section of the page, but the GPU kernel's (no results here)
        assert callable(getattr(module, "render", None)) or f == "kernel_cuda", f
    assert study("prefill_cost").file_for(["--quick", "--mode", "kvzip"]) == "kvzip_cost"
    with pytest.raises(SystemExit):  # a mode the study does not have
        study("decode").file_for(["--mode", "nope"])
    with pytest.raises(ValueError, match="no registered study writes"):
        owner("geometry")


def test_a_mode_option_is_accepted_by_the_modes_parser_only():
    args = parse(parser("x", file="batch_step", reps=5), ["--mode", "batch", "--quick"])
    assert args.mode == "batch" and args.reps == 2
    with pytest.raises(SystemExit):
        parse(parser("x", file="batch_step"), ["--mode", "nope"])
    with pytest.raises(SystemExit):
        parse(parser("x", file="long_context"), ["--haystack", "prose"])


def test_studies_run_mlx_on_openblas_through_the_one_entry_point() -> None:
    """Without OpenBLAS preloaded, MLX's CPU matmul here is ~30x slower: a study that forgot
    it once ran for hours instead of minutes. ``python -m bench`` re-executes with it before
    any study is imported, and no study module re-executes on its own."""
    bench = Path(__file__).parents[2] / "bench"
    entry = ast.parse((bench / "__main__.py").read_text())
    called = {
        n.func.id
        for n in ast.walk(entry)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
    }
    assert "reexec_with_openblas" in called
    for module in (bench / "studies").glob("*.py"):
        assert "reexec_with_openblas" not in module.read_text(), module.name


def test_a_profile_chunk_as_long_as_its_context_is_refused(tmp_path):
    from bench.studies.decode import profile

    with pytest.raises(SystemExit, match="must be below --context"):
        profile.main(["--quick", "--context", "64", "--chunk", "64", "--out", str(tmp_path)])
