"""What a long study writes as it goes: progress on stderr, and each record appended to a
JSONL log at once, so that a stopped run resumes where it stopped."""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any


def jsonable(x: Any) -> Any:
    """``x`` with numpy values as lists and numbers, NaN as ``None`` and paths as strings."""
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if hasattr(x, "tolist"):  # numpy arrays and scalars
        return jsonable(x.tolist())
    if isinstance(x, float) and not math.isfinite(x):
        return None  # JSON has no NaN
    return str(x) if isinstance(x, Path) else x


def read_jsonl(
    path: Path, keep: Callable[[dict[str, Any]], bool] = lambda r: True
) -> Iterator[dict]:
    """The records of a study's log that ``keep`` accepts (none if the file is missing)."""
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip() and keep(rec := json.loads(line)):
                yield rec


def resume(
    path: Path,
    key: Callable[[dict[str, Any]], Any],
    *,
    fresh: bool = False,
    keep: Callable[[dict[str, Any]], bool] = lambda r: True,
) -> dict[Any, dict]:
    """The records of a study's log that ``keep`` accepts, by ``key``; with ``fresh`` (quick
    runs) the log is deleted first."""
    if fresh:
        path.unlink(missing_ok=True)
    return {key(r): r for r in read_jsonl(path, keep)}


def measured(
    log: Path | None, done: dict[Any, dict], todo: Sequence[Any], measure: Callable, desc: str
) -> list[dict[str, Any]]:
    """The record of each key of ``todo``: read back (``done``, from :func:`resume`) or
    ``measure(*key)``, appended to ``log`` at once (if any) so that a stopped run resumes."""
    with progress(total=len(todo), desc=desc) as bar:
        for key in todo:
            if key not in done:
                done[key] = measure(*key)
                if log is not None:  # appended and closed at once: a stopped run resumes
                    log.parent.mkdir(parents=True, exist_ok=True)
                    with log.open("a") as f:
                        f.write(json.dumps(jsonable(done[key])) + "\n")
            bar.update(1)
    return [done[key] for key in todo]


def progress(**kwargs: Any) -> Any:
    """A tqdm bar; in a log file (no terminal) it writes a line every 30 s, not every step."""
    from tqdm import tqdm

    if not sys.stderr.isatty():
        kwargs.setdefault("mininterval", 30.0)
    return tqdm(**kwargs)


class Progress:
    """One line per step on stderr, with the elapsed time: ``[decode 12.3s] context 1024``."""

    def __init__(self, study: str) -> None:
        self.study, self.start = study, time.perf_counter()

    def __call__(self, message: str) -> None:
        elapsed = time.perf_counter() - self.start
        print(f"[{self.study} {elapsed:6.1f}s] {message}", file=sys.stderr, flush=True)

    def rounds(self, label: str) -> Callable[[int, int], None]:
        """A callback for :func:`interleave`."""
        return lambda done, total: self(f"{label}: round {done}/{total}")
