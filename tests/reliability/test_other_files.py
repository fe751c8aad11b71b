"""Broken calibration and kept-cache files: every mutant of a valid one is refused (a
calibration: exit 2 and one line naming it, checked in test_calibration_faults.py; a kept
cache: skipped, named in one log line) or read as valid, within seconds, never a crash. Each
corpus runs in its own process (:mod:`tests.reliability.file_fuzz`), so a crash in native
code fails the test instead of killing the suite."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.reliability.file_fuzz import LIMIT_S
from tests.reliability.harness import REPO, current_size


@pytest.mark.parametrize("kind", ["calibration", "cache"])
def test_mutated_files_are_refused_or_read_never_crash(kind):
    n = current_size().model_files
    done = subprocess.run(
        [sys.executable, "-m", "tests.reliability.file_fuzz", kind, str(n)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60 + n,
    )
    assert done.returncode == 0, done.stderr[-3000:]  # a crash in native code ends here
    summary = json.loads(done.stdout.splitlines()[-1])
    print(
        f"\n{n} mutated {kind} files: {summary['outcomes']}; slowest {summary['slowest_s']:.3f} s"
    )
    assert summary["crashes"] == [], json.dumps(summary["crashes"][:3], indent=1)
    assert summary["outcomes"].get("refused", 0) > n // 2  # the mutations mostly break the file
    assert summary["slowest_s"] <= LIMIT_S


def test_a_kept_cache_whose_header_puts_text_in_its_state_is_refused(tmp_path):
    """The full-size run's finding (seed 0, mutant 1627): a layer's state number rewritten
    to text restored into a cache whose keys were a string."""
    from tests.reliability.file_fuzz import _join, _split, bases, verdict

    path = bases(tmp_path)["cache"]
    _, header, body = _split(path.read_bytes())
    inner = json.loads(header["__metadata__"]["qfserve"])
    inner["layers"][0]["numbers"] = {"0": "x"}
    header["__metadata__"]["qfserve"] = json.dumps(inner)
    path.write_bytes(_join(header, body))
    outcome, _, message = verdict("cache", path)
    assert outcome == "refused" and "not integers" in message, message
