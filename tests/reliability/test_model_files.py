"""Broken model files at start-up: every mutant of a small valid GGUF is served (it is still
valid) or refused in one line naming it, within seconds, never a traceback, hang or crash;
the command line turns a refusal into exit status 2 without outgrowing 300 MB."""

from __future__ import annotations

import collections
import json
import shutil
import subprocess
import sys

import pytest

from tests.caches import fresh_cache
from tests.reliability.harness import REPO, current_size
from tests.reliability.model_fuzz import FINDINGS, LIMIT_S, corpus, rebuilt, verdict

MAX_RSS_MB = 300


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache folder of its own (a served mutant's converted folder goes there) sharing the
    user's built native kernels, so the first served mutant does not build them again."""
    return fresh_cache(tmp_path_factory.mktemp("cache")) / "qfserve"


def test_mutated_gguf_files_are_served_or_refused_never_crash(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("QFSERVE_CACHE", str(cache))
    n = current_size().model_files
    outcomes: collections.Counter[str] = collections.Counter()
    by_kind: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    crashes, slowest = [], 0.0
    for what, path in corpus(tmp_path, n):
        v = verdict(path)
        outcomes[v.outcome] += 1
        by_kind[what.split("/")[1]][v.outcome] += 1
        if v.outcome in ("crash", "slow"):
            crashes.append((what, path.name, v.message[-1500:]))
            shutil.copy(path, tmp_path / f"keep-{path.name}")
        elif v.outcome == "refused":
            slowest = max(slowest, v.seconds)
            assert path.name in v.message  # the line names the file
        path.unlink()
        shutil.rmtree(cache / "models", ignore_errors=True)
    print(f"\n{n} mutated GGUF files: {dict(outcomes)}; slowest refusal {slowest:.2f} s")
    for kind, counts in sorted(by_kind.items()):
        print(f"  {kind}: {dict(counts)}")
    assert not crashes, "\n\n".join(f"{w} ({name}):\n{m}" for w, name, m in crashes[:5])
    assert outcomes["refused"] > n // 2  # the mutations mostly break the file
    assert slowest <= LIMIT_S


def test_kept_findings_stay_fixed(tmp_path, cache, monkeypatch):
    monkeypatch.setenv("QFSERVE_CACHE", str(cache))
    findings = json.loads(FINDINGS.read_text())
    assert findings
    for finding in findings:
        path = rebuilt(tmp_path / str(finding["seed"]), finding["seed"], finding["index"])
        v = verdict(path)
        assert v.outcome == "refused", (finding, v.message)


def test_the_command_line_refuses_in_one_line_with_status_2(tmp_path, cache):
    """A handful of mutants through ``qfserve --model``: status 2, one line naming the file,
    no traceback, the process under 300 MB at its peak."""
    picked = {}
    for what, path in corpus(tmp_path, 400, seed=7):
        kind = what.split("/")[1]
        if kind not in picked and verdict(path).outcome == "refused":
            picked[kind] = path
    assert len(picked) >= 8, sorted(picked)
    env = {"QFSERVE_CACHE": str(cache), "PATH": "/usr/bin:/bin"}
    for kind, path in sorted(picked.items()):
        command = [sys.executable, "-m", "qfserve.server.cli", "--log-level", "warning"]
        run = subprocess.run(
            [sys.executable, "-c", MEASURED, *command, "--model", str(path)],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        lines = [line for line in run.stderr.splitlines() if line.strip()]
        assert run.returncode == 2, (kind, run.stderr[-2000:])
        assert len(lines) == 1 and path.name in lines[0] and "Traceback" not in run.stderr, (
            kind,
            run.stderr[-2000:],
        )
        peak_mb = int(run.stdout) / 1024
        assert peak_mb <= MAX_RSS_MB, f"refusing {kind} peaked at {peak_mb:.0f} MB"


# Runs the command as its only child and prints that child's peak RSS (KiB): the test
# process's own children (every server the suite started) would count in its figure.
MEASURED = """
import resource, subprocess, sys
code = subprocess.run(sys.argv[1:]).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.exit(code)
"""
