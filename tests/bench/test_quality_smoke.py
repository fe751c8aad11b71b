"""The quality studies' plumbing, beyond the registry's smoke test (:mod:`test_studies`): every
evicting arm kept exactly its budget, the retrieval study's shared prefill matches a direct
``generate_step``, the long studies resume from their logs, and the arm options do what they
say (extra runs on a tiny random model). The sizes are far too small to mean anything.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from qfserve.engine.kv.kvzap import decode_room
from tests.tiny import save_tiny_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("model") / "tiny")


def test_calibration_is_fresh_and_disjoint_from_eval(quick: Callable, results: Path) -> None:
    cal = quick("perplexity")["calibration"]
    assert cal["source"] == "fresh" and cal["disjoint_from_eval"] is True


def test_every_perplexity_arm_kept_exactly_its_budget(quick: Callable, results: Path) -> None:
    data = quick("perplexity")
    assert {"kvzap/r0", "kvzap/r25"} <= set(data["arms"])  # --kvzap
    for res in data["results"].values():
        for budget, arms in res["budgets"].items():
            assert set(arms) == set(data["arms"]) - {"full"}
            for name, r in arms.items():
                # KVzap's rows shared across layers: and their decode room between shares
                shared = name.startswith("kvzap/") and name.endswith("/global")
                room = decode_room(int(budget)) if shared else 0
                assert r["rows_kept_at_end"] == int(budget)
                assert r["max_rows_any_step"] <= int(budget) + room
                assert (r["filter_source"] == "kvzap") == name.startswith("kvzap")


def test_kvzap_surrogates_are_trained_on_training_split_text(quick: Callable) -> None:
    for file in ("perplexity", "retrieval", "niah"):
        zap = quick(file)["calibration"]["kvzap"]
        assert zap["source"] == "fresh" and zap["disjoint_from_eval"] is True
        assert zap["form"] == "linear" and -1 <= zap["spearman_median"] <= 1


def test_retrieval_shared_prefill_matches_generate_step(quick: Callable, results: Path) -> None:
    data = quick("retrieval")
    lines = (results / "retrieval.jsonl").read_text().splitlines()
    assert len(lines) == sum(r["docs"] for r in data["results"].values())  # one per document
    check = data["shared_prefill_check"]
    assert check["arms"] > 0 and check["identical"] == check["arms"], check["mismatches"]
    names = {name.split("/")[0] for res in data["results"].values() for name in res["arms"]}
    assert {"snapkv", "tova", "kvzip", "kvzap"} <= names
    for res in data["results"].values():
        for cells in res["arms"].values():
            for c in cells.values():
                assert 0 <= c["accuracy"] <= 1 and c["answer_nll_mean"] > 0


def test_only_keeps_the_named_arms_and_refuses_unknown_ones(
    results: Path, tiny_model: Path
) -> None:
    from bench.studies.retrieval.retrieval import main

    out = results / "retrieval-only"
    argv = [
        "--quick",
        "--model",
        str(tiny_model),
        "--out",
        str(out),
        "--calibration",
        "fresh",
        "--query-aware",
        "--only",
        "qfilters/r25",
        "snapkv/r25",
        "streaming/r0",
        "--no-prefill-check",
    ]
    main(argv)
    data = json.loads((out / "retrieval.json").read_text())
    assert data["arms"] == ["full", "qfilters/r25", "streaming/r0", "snapkv/r25"]
    assert data["prefill_check_skipped"] is True and data["shared_prefill_check"]["arms"] == 0
    for res in data["results"].values():
        assert set(res["arms"]) == set(data["arms"])
    with pytest.raises(ValueError, match="unknown arms"):
        main([*argv[:-2], "qfilters/r25/c4"])


def test_perplexity_resumes_from_its_log(results: Path, tiny_model: Path) -> None:
    """A full-size run appends one line per (data set, budget, arm) and, run again, reads
    them back instead of recomputing: the same figures, no new lines."""
    from bench.studies.perplexity import main

    out = results / "perplexity-resume"
    argv = [
        "--model",
        str(tiny_model),
        "--out",
        str(out),
        "--calibration",
        "fresh",
        "--length",
        "64",
        "--sequences",
        "2",
        "--budgets",
        "16",
        "--datasets",
        "prose",
    ]
    main(argv)
    lines = (out / "perplexity.jsonl").read_text().splitlines()
    assert [json.loads(line)["arm"] for line in lines] == [
        "qfilters/r25",
        "knorm/r25",
        "streaming/r0",
    ]
    first = json.loads((out / "perplexity.json").read_text())["results"]
    main(argv)
    assert (out / "perplexity.jsonl").read_text().splitlines() == lines
    again = json.loads((out / "perplexity.json").read_text())["results"]
    for name, row in first["prose"]["budgets"]["16"].items():
        assert again["prose"]["budgets"]["16"][name]["ppl"] == pytest.approx(row["ppl"], rel=1e-6)


def test_perplexity_reads_a_prompt_in_blocks_without_streaming(
    results: Path, tiny_model: Path
) -> None:
    """``--prompt`` with ``--only`` leaving streaming out: the arms run, logged with how they
    were fed (a one-token-per-step log line is not read back for them), and the gap to
    streaming is left empty rather than made up."""
    from bench.studies.perplexity import main

    out = results / "perplexity-prompt"
    argv = [
        "--model",
        str(tiny_model),
        "--out",
        str(out),
        "--calibration",
        "fresh",
        "--length",
        "64",
        "--sequences",
        "2",
        "--budgets",
        "16",
        "--datasets",
        "prose",
        "--only",
        "qfilters/r25",
        "knorm/r25",
    ]
    main(argv)
    main([*argv, "--prompt"])
    lines = [json.loads(line) for line in (out / "perplexity.jsonl").read_text().splitlines()]
    assert [(r["arm"], r["prompt_block"]) for r in lines] == [
        ("qfilters/r25", None),
        ("knorm/r25", None),
        ("qfilters/r25", 512),
        ("knorm/r25", 512),
    ]
    rows = json.loads((out / "perplexity.json").read_text())["results"]["prose"]["budgets"]["16"]
    assert set(rows) == {"qfilters/r25", "knorm/r25"}
    assert all(r["gap_closed_vs_streaming"] is None and r["ppl"] > 1 for r in rows.values())


def test_niah_places_the_needle_and_resumes(
    quick: Callable, results: Path, tiny_model: Path
) -> None:
    from bench.studies.retrieval.niah import main

    data = quick("niah")
    assert {r["target_depth"] for r in data["records"]} == set(data["depths"])
    assert "kvzap/r25" in data["grid"]  # --kvzap, beside kvzip and Q-Filters
    for r in data["records"]:
        assert abs(r["depth"] - r["target_depth"]) < 0.35  # paragraph boundaries are coarse
        assert abs(r["tokens"] - r["length"]) <= 0.25 * r["length"]
        for cells in r["arms"].values():
            for c in cells.values():
                assert isinstance(c["correct"], bool) and c["answer_nll"] > 0
    for cells in data["grid"].values():
        for rows in cells.values():
            assert all(v is None or 0 <= v <= 1 for row in rows for v in row)
    # A full run appends one line per document and skips those already done.
    out = results / "niah-resume"
    argv = [
        "--model",
        str(tiny_model),
        "--out",
        str(out),
        "--calibration",
        "fresh",
        "--lengths",
        "320",
        "--depths",
        "0",
        "1",
        "--ratios",
        "4",
    ]
    main(argv)
    lines = (out / "niah.jsonl").read_text().splitlines()
    assert len(lines) == 2
    main(argv)
    assert (out / "niah.jsonl").read_text().splitlines() == lines


@pytest.mark.parametrize("method", ["qfilters", "fallback", "knorm", "streaming"])
def test_block_prefill_matches_token_by_token(method: str) -> None:
    """The teacher-forcing shortcut (first tokens as one block) stores and predicts the same."""
    import numpy as np

    from bench.arms import Arm, prefill_length, streaming_nll
    from tests.tiny import make_tiny_model

    model = make_tiny_model(seed=1)
    tokens = np.random.default_rng(0).integers(0, 500, size=(2, 48))
    filters = np.random.default_rng(1).standard_normal((2, 2, 32)).astype(np.float32)
    filters /= np.linalg.norm(filters, axis=-1, keepdims=True)
    arm, budget = Arm(method, 0.25), 16
    calib = arm.config(budget).calib_tokens if method == "fallback" else None
    runs = []
    for prefill in (prefill_length(budget, calib), 1):
        caches = arm.caches(model, budget, filters if method == "qfilters" else None)
        nll, max_rows = streaming_nll(model, tokens, caches, budget=budget, prefill=prefill)
        runs.append((nll, max_rows, [np.array(c.keys) for c in caches]))
    (a, rows_a, keys_a), (b, rows_b, keys_b) = runs
    assert rows_a == rows_b == budget
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    for ka, kb in zip(keys_a, keys_b, strict=True):
        np.testing.assert_allclose(ka, kb, rtol=1e-5, atol=1e-5)


def test_multiturn_recall_asks_the_fresh_arm_on_the_reused_arms_text(
    quick: Callable, results: Path
) -> None:
    """A reuse arm holds the whole conversation and continues its caches from turn 2 on,
    unless the prompt does not start with what they hold (a counted miss); its fresh sibling
    answers only at the ask turns, on the same prompt, with nothing cached. Every ask has the
    key's likelihood."""
    data = quick("multiturn_recall")
    ask, turns = data["settings"]["ask"], data["settings"]["turns"]
    rows = {row["arm"]: row for row in data["rows"]}
    assert set(rows) == set(data["accuracy"]) == set(data["key_nll"]) and "full/reuse" in rows
    for name, row in rows.items():
        if name.endswith("/fresh"):
            continue
        assert [t["turn"] for t in row["turns"]] == list(range(1, turns + 1))
        assert row["turns"][0]["cached_tokens"] == 0
        for before, now in itertools.pairwise(row["turns"]):
            assert now["prompt_tokens"] > before["prompt_tokens"]
            # What the caches held: the previous prompt and every token answered to it.
            held = before["prompt_tokens"] + before["completion_tokens"]
            assert now["cached_tokens"] in (0, held)
        assert row["misses"] == sum(t["cached_tokens"] == 0 for t in row["turns"][1:])
        if name == "full/reuse":  # a full cache holds every token fed: prompt and answer
            for t in row["turns"]:
                assert t["tokens_kept"] == t["prompt_tokens"] + t["completion_tokens"]
        assert data["reuse_hits"][name] == turns - 1 - row["misses"]
        fresh = rows.get(name.replace("/reuse", "/fresh"))
        if fresh is None:
            assert name == "full/reuse"
            continue
        assert [t["turn"] for t in fresh["turns"]] == ask
        for t in fresh["turns"]:
            assert t["cached_tokens"] == 0
            assert t["prompt_tokens"] == row["turns"][t["turn"] - 1]["prompt_tokens"]
        for r in (row, fresh):
            by_turn = {t["turn"]: t for t in r["turns"]}
            assert r["right"] == [r["key"] in by_turn[k]["answer"] for k in ask]
            assert r["key_nll"] == [by_turn[k]["key_nll"] for k in ask]
            assert all(x > 0 for x in r["key_nll"])


def test_a_prompt_read_in_blocks_predicts_as_one_pass_and_keeps_the_budget() -> None:
    """``--prompt`` feeding: a full cache fed the first half in blocks predicts what one
    forward pass over the sequence does; evicting arms whose blocks overflow the budget hold
    exactly the budget after every block and step."""
    import numpy as np

    from bench.arms import Arm, full_nll, kept_rows, streaming_nll
    from tests.tiny import make_tiny_model

    model = make_tiny_model(seed=1)
    tokens = np.random.default_rng(0).integers(0, 500, size=(2, 64))
    filters = np.random.default_rng(1).standard_normal((2, 2, 32)).astype(np.float32)
    filters /= np.linalg.norm(filters, axis=-1, keepdims=True)
    full_caches = Arm("full", 0.0).caches(model, None, None)
    nll, _ = streaming_nll(model, tokens, full_caches, budget=None, prefill=32, block=10)
    np.testing.assert_allclose(nll, full_nll(model, tokens), rtol=1e-4, atol=1e-4)
    for arm in (Arm("qfilters", 0.25), Arm("knorm", 0.25), Arm("streaming", 0.0)):
        caches = arm.caches(model, 12, filters)
        fed, seen = [0], []

        def count(n: int, caches: list = caches, fed: list = fed, seen: list = seen) -> None:
            fed[0] += n
            seen.append((fed[0], set(kept_rows(caches))))

        nll, max_rows = streaming_nll(
            model, tokens, caches, budget=12, prefill=32, block=16, on_step=count
        )
        assert max_rows == 12 and nll.shape == (2, 63) and np.isfinite(nll).all()
        assert seen[:2] == [(16, {12}), (32, {12})]  # each block evicted down to the budget
        assert all(rows == {12} for _, rows in seen) and fed[0] == 63
        assert all(c.evictions > 0 for c in caches)


def test_a_kvzip_prompt_read_in_blocks_is_held_whole_until_its_pass() -> None:
    """``--prompt --kvzip`` with a prompt longer than a block: kvzip keeps every prompt row
    until the reconstruction pass (no budget check refuses the blocks before it), and from
    the pass on every step holds the budget."""
    from functools import partial

    import numpy as np

    from bench.arms import Arm, kept_rows, streaming_nll
    from qfserve.engine.kv.kvzip import RepeatPrompt, compress
    from tests.tiny import make_tiny_model

    model = make_tiny_model(seed=1)
    tokens = np.random.default_rng(0).integers(0, 500, size=(1, 64))
    repeat = RepeatPrompt(first=(7, 8, 9), next=(10, 11), suffix=(12,))
    filters = np.random.default_rng(1).standard_normal((2, 2, 32)).astype(np.float32)
    filters /= np.linalg.norm(filters, axis=-1, keepdims=True)  # ranks the generated rows
    caches = Arm("kvzip", 0.25).caches(model, 12, filters)
    fed, seen = [0], []

    def count(n: int) -> None:
        fed[0] += n
        seen.append((fed[0], max(kept_rows(caches))))

    after = partial(compress, model, caches, tokens[0, :32].tolist(), repeat)
    _, max_rows = streaming_nll(
        model, tokens, caches, budget=12, prefill=32, block=16, on_step=count, after_prefill=after
    )
    assert seen[0] == (16, 16)  # the first block, kept whole
    assert seen[1] == (32, 12)  # the pass ran at the prompt's end and evicted to the budget
    assert max_rows == 12 and all(rows == 12 for _, rows in seen[1:]) and fed[0] == 63


def test_kvzip_reuse_runs_kvzap_through_the_worker(
    results: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--conversation document --kvzap``: the worker finds the model's surrogates in the
    registry as a server does (here a quick one trained for qfserve-tiny, in a folder on
    ``$QFSERVE_CALIBRATIONS``), and the kvzap conversation keeps its budget every turn."""
    from bench.cli import BUNDLED
    from bench.run import identity
    from bench.studies.multiturn_recall.kvzip_reuse import main
    from bench.surrogates import surrogate_for
    from qfserve.calibrations.kvzap.surrogate import save_surrogate
    from qfserve.calibrations.registry import find_surrogate, model_id_for, surrogate_name
    from qfserve.engine.models.loading import load_model, resolve_model_ref

    folder = Path(resolve_model_ref(BUNDLED))
    loaded = load_model(str(folder))
    found = identity(loaded, folder)
    surrogate, _ = surrogate_for(loaded.model, loaded.tokenizer, found, mode="fresh", quick=True)
    model_id, registry = model_id_for(found["model_id"]), results / "kvzap-registry"
    save_surrogate(registry / surrogate_name(model_id), surrogate)
    out = results / "kvzip-reuse-kvzap"
    monkeypatch.delenv("QFSERVE_CALIBRATIONS", raising=False)
    if find_surrogate(model_id) is None:  # none on this machine's search path: refused
        with pytest.raises(ValueError, match="qfserve calibrate --kvzap"):
            main(["--quick", "--kvzap", "--out", str(out)])
    monkeypatch.setenv("QFSERVE_CALIBRATIONS", str(registry))
    data = main(["--quick", "--kvzap", "--out", str(out)])
    assert "kvzap/r25" in data["arms"] and "kvzap/r25" in data["accuracy"]
    assert data["every_later_turn_reused"] is True
    for r in data["records"]:
        if r["arm"] == "kvzap/r25":
            assert r["kept"] == [r["budget"]] * len(r["kept"])
