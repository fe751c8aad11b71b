"""The model runs on its own thread: the kernels' helpers must evaluate there too."""

from __future__ import annotations

import threading

import mlx.core as mx
import numpy as np

from qfserve.kernels.qfilters_apply import rank_scores


def test_ranks_built_on_one_thread_evaluate_on_another():
    # A lazy array belongs to the stream of the thread that built it: a mask cached on one
    # thread and evaluated on the model's failed with "There is no Stream(cpu, 0) in current
    # thread". Masks are now built in the graph of the call that uses them.
    scores = mx.array(np.random.default_rng(0).standard_normal((1, 2, 37)).astype(np.float32))
    rank_scores(scores, 3, 5)  # built here, never evaluated here
    out: dict[str, object] = {}

    def model_thread() -> None:
        try:
            with mx.stream(mx.new_stream(mx.default_device())):
                out["ranked"] = np.array(rank_scores(scores, 3, 5))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            out["error"] = exc

    thread = threading.Thread(target=model_thread)
    thread.start()
    thread.join()
    assert "error" not in out, out.get("error")
    want = np.array(scores)
    want[..., :3] = np.inf
    want[..., -5:] = np.inf
    np.testing.assert_array_equal(out["ranked"], want)
