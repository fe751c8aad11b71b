"""The apply kernel's own text, executed on the CPU: one OS thread per GPU thread.

The neutral-dialect body is rendered a third way — shared memory as function statics,
barriers as ``std::barrier`` — compiled with g++ and run group by group. This executes the
exact lines the GPU runs (indices, scan, tiers, copy), not a transcription of them. Skipped
visibly where no C++20 compiler is installed.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess

import numpy as np
import pytest

from qfserve.kernels import sources
from tests.kernels._reference import KINDS, argsort_keep, make_scores

CXX = shutil.which("g++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler: kernel text not executed")

THREADS = (1, 7, 32, sources.DEFAULT_THREADS)
_CPU_TOKENS = {
    "QF_FUNC": "inline",
    "QF_SHARED": "static",
    "QF_BARRIER": "qf_bar->arrive_and_wait()",
    "QF_GROUP": "qf_group",
    "QF_THREAD": "qf_thread",
    "QF_INF": "INFINITY",
}
_HARNESS = """
#include <barrier>
#include <cmath>
#include <cstddef>
#include <thread>
#include <vector>
typedef unsigned int uint;
static thread_local uint qf_group, qf_thread;
static std::barrier<>* qf_bar;
{header}
{kernels}
"""
_KERNEL = """
static void apply_{tg}(const float* keys, const float* values, const float* scores,
                       const float* thresh, const int* params,
                       float* out_keys, float* out_values, float* out_scores) {{
  constexpr int TG = {tg};
  constexpr int MAX_BUDGET = {max_budget};
{body}
}}
extern "C" void run_apply_{tg}(int groups, const float* keys, const float* values,
                               const float* scores, const float* thresh, const int* params,
                               float* out_keys, float* out_values, float* out_scores) {{
  for (int g = 0; g < groups; ++g) {{
    std::barrier<> bar({tg});
    qf_bar = &bar;
    std::vector<std::thread> threads;
    for (uint t = 0; t < {tg}; ++t) {{
      threads.emplace_back([=] {{
        qf_group = g;
        qf_thread = t;
        apply_{tg}(keys, values, scores, thresh, params, out_keys, out_values, out_scores);
      }});
    }}
    for (auto& th : threads) th.join();
  }}
}}
"""


def cpu_render(text: str) -> str:
    return re.sub(r"\bQF_[A-Z_]+\b", lambda m: _CPU_TOKENS[m.group(0)], text)


@pytest.fixture(scope="module")
def library(tmp_path_factory):
    kernels = "".join(
        _KERNEL.format(tg=tg, max_budget=sources.MAX_BUDGET, body=cpu_render(sources.APPLY.body))
        for tg in THREADS
    )
    src = _HARNESS.format(header=cpu_render(sources._HEADER), kernels=kernels)
    d = tmp_path_factory.mktemp("kernel_text")
    (d / "apply.cpp").write_text(src)
    cmd = [CXX, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-Wall", "-Werror"]
    proc = subprocess.run(
        [*cmd, "-o", str(d / "apply.so"), str(d / "apply.cpp")], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return ctypes.CDLL(str(d / "apply.so"))


def run(lib, keys, values, scores, thresh, *, budget, n_sink, recent, threads):
    G, L, D = keys.shape
    Dv = values.shape[-1]
    params = np.array([L, D, Dv, budget, n_sink, recent], dtype=np.int32)
    outs = [
        np.full((G, budget, D), np.nan, np.float32),
        np.full((G, budget, Dv), np.nan, np.float32),
    ]
    outs.append(np.full((G, budget), np.nan, np.float32))
    bufs = [keys, values, scores, thresh, params, *outs]
    ptrs = [ctypes.c_void_p(np.ascontiguousarray(b).ctypes.data) for b in bufs]
    getattr(lib, f"run_apply_{threads}")(ctypes.c_int(G), *ptrs)
    return outs


def host_threshold(scores, budget, n_sink, recent):
    L = scores.shape[-1]
    rows = np.arange(L)
    ranked = np.where(np.isnan(scores), -np.inf, scores)
    ranked = np.where((rows < n_sink) | (rows + recent >= L), np.inf, ranked).astype(np.float32)
    return np.ascontiguousarray(np.partition(ranked, L - budget, axis=-1)[:, L - budget])


CASES = [
    # (G, L, budget, n_sink, recent)
    (3, 101, 40, 2, 5),
    (1, 500, 500, 4, 4),  # budget = rows
    (2, 90, 14, 4, 9),  # budget = n_sink + recent + 1
    (2, 64, 20, 40, 40),  # every row protected
    (64, 33, 10, 1, 2),  # 64 groups
    (2, 5, 3, 0, 0),  # fewer rows than threads
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("G, L, budget, n_sink, recent", CASES)
def test_kernel_text_matches_the_argsort_oracle(library, kind, G, L, budget, n_sink, recent):
    check(library, kind, G, L, budget, n_sink, recent, threads=32)


# One OS thread per GPU thread is slow to start, so the other widths run on fewer cases.
@pytest.mark.parametrize("threads", [1, 7, sources.DEFAULT_THREADS])
@pytest.mark.parametrize("kind", ["ties", "constant"])
@pytest.mark.parametrize("G, L, budget, n_sink, recent", [CASES[0], CASES[3], CASES[5]])
def test_kernel_text_at_other_threadgroup_widths(
    library, threads, kind, G, L, budget, n_sink, recent
):
    check(library, kind, G, L, budget, n_sink, recent, threads=threads)


def check(library, kind, G, L, budget, n_sink, recent, *, threads):
    rng = np.random.default_rng(G * 1000 + L)
    scores = make_scores(rng, (G, L), kind)
    keys = rng.standard_normal((G, L, 4)).astype(np.float32)
    values = rng.standard_normal((G, L, 3)).astype(np.float32)
    thresh = host_threshold(scores, budget, n_sink, recent)
    k, v, s = run(
        library, keys, values, scores, thresh,
        budget=budget, n_sink=n_sink, recent=recent, threads=threads,
    )  # fmt: skip
    want = argsort_keep(scores, budget, n_sink, recent)
    take = np.arange(G)[:, None]
    np.testing.assert_array_equal(k.view(np.uint32), keys[take, want].view(np.uint32))
    np.testing.assert_array_equal(v.view(np.uint32), values[take, want].view(np.uint32))
    np.testing.assert_array_equal(s.view(np.uint32), scores[take, want].view(np.uint32))
