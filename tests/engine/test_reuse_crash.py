"""Kept caches on disk survive a server killed mid-write: ``kill -9`` a process writing entries
through :func:`qfserve.engine.reuse.disk.save`, 20 times at random moments, and every folder
that follows loads only whole entries, each equal to what was written; a file damaged after
it was written is refused by its checksum, and the log names it."""

from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.reuse import disk as persist
from qfserve.engine.reuse.kept import cache_key

LAYERS, ROWS = 30, 512  # ~24 MB an entry: a write long enough to be cut


def entry(i: int) -> tuple[tuple, list[int], list[KVCache]]:
    """Entry ``i``: its key, tokens and caches, the same in every process."""
    rng = np.random.default_rng(i)
    caches = []
    for _ in range(LAYERS):
        c = KVCache()
        kv = mx.array(rng.standard_normal((1, 3, ROWS, 64), dtype=np.float32))
        c.update_and_fetch(kv, kv * 2)
        caches.append(c)
    return cache_key("m", CacheConfig(method="full"), "none", f"c{i}"), list(range(i + 1)), caches


WRITER = """
import os, stat, sys, time
from tests.engine.test_reuse_crash import entry, persist
from pathlib import Path
folder, start, paused = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "paused"
flush = os.fsync
def announced(fd):  # the entry's bytes are written, not yet flushed nor renamed
    if paused and stat.S_ISREG(os.fstat(fd).st_mode):
        print("flushing", flush=True)
        time.sleep(5)
    flush(fd)
os.fsync = announced
for i in range(start, start + 1000):
    key, tokens, caches = entry(i)
    print(i, flush=True)
    persist.save(folder, key, tokens, caches, "fp")
"""


def fresh(config: CacheConfig) -> list[KVCache]:
    return [KVCache() for _ in range(LAYERS)]


def check_folder(folder: Path, limit: int = 10_000) -> int:
    """The ``limit`` newest entries ``load_folder`` restores equal what was written; returns
    how many it restored."""
    restored = persist.load_folder(folder, "fp", fresh, limit=limit)
    for key, tokens, caches in restored:
        i = int(key[-1][1:])
        want_key, want_tokens, want = entry(i)
        assert (key, tokens) == (want_key, want_tokens)
        for a, b in zip(want, caches, strict=True):
            assert b.offset == a.offset
            np.testing.assert_array_equal(np.array(b.state[0]), np.array(a.state[0]))
            np.testing.assert_array_equal(np.array(b.state[1]), np.array(a.state[1]))
    assert not list(folder.glob(f"*{persist.TEMPORARY}"))  # a dead writer's temporaries
    return len(restored)


def test_kill_9_mid_write_never_leaves_a_partial_entry(tmp_path):
    """Every other kill lands at a random moment of a run of writes; the rest land once an
    entry's bytes are written and before they are flushed and renamed (the writer says so)."""
    rng, written, cuts = random.Random(0), 0, 0
    for k in range(12):
        paused = k % 2 == 1
        writer = subprocess.Popen(
            [
                sys.executable,
                "-c",
                WRITER,
                str(tmp_path),
                str(written),
                "paused" if paused else "free",
            ],
            stdout=subprocess.PIPE,
            text=True,
            cwd=Path(__file__).resolve().parents[2],
        )
        assert writer.stdout is not None
        for _ in range(rng.randint(1, 3)):  # an entry is being written once its line is out
            started = int(writer.stdout.readline())
            if paused:
                assert writer.stdout.readline().strip() == "flushing"
                break
        else:
            time.sleep(rng.uniform(0.0, 0.06))  # a write takes some tens of ms here
        writer.send_signal(signal.SIGKILL)
        writer.wait()
        cuts += bool(list(tmp_path.glob(f"*{persist.TEMPORARY}")))
        written = started + 1
        check_folder(tmp_path, limit=3)  # the newest: any a kill could have touched
    assert check_folder(tmp_path) == len(list(tmp_path.glob("*" + persist.SUFFIX))) > 0
    assert cuts >= 6, f"only {cuts} of 12 kills landed mid-write: the test did not test"


def test_a_damaged_entry_is_refused_by_name(tmp_path, caplog):
    key, tokens, caches = entry(0)
    path = persist.save(tmp_path, key, tokens, caches, "fp")
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # a bit of the last array's bytes
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        assert persist.load_folder(tmp_path, "fp", fresh, limit=10) == []
    assert any(path.name in r.message and "checksum" in r.message for r in caplog.records)
    path.write_bytes(bytes(data[: len(data) // 2]))  # cut short by a copy
    with caplog.at_level(logging.WARNING):
        assert persist.load_folder(tmp_path, "fp", fresh, limit=10) == []


def test_a_live_writers_temporary_is_left_alone(tmp_path):
    mine = tmp_path / f"a{persist.SUFFIX}.{os.getppid()}{persist.TEMPORARY}"
    dead = tmp_path / f"b{persist.SUFFIX}.999999999{persist.TEMPORARY}"
    for f in (mine, dead):
        f.write_bytes(b"partial")
    assert persist.remove_orphans(tmp_path) == [dead]
    assert mine.exists() and not dead.exists()
