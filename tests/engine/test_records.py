"""What the admin endpoint reads about finished requests: a failure keeps its reason."""

from __future__ import annotations

import time

from qfserve.engine.models.loading import load_model
from qfserve.engine.serving.config import EngineConfig, request_cache
from qfserve.engine.text.requests import Failed, Finished, GenerationRequest, SamplingParams
from tests.workers import complete, serving, worker_for


def test_a_failed_request_keeps_its_reason_and_a_finished_one_none():
    loaded = load_model("qfserve-tiny")
    cache = request_cache(EngineConfig(), {})[0]

    def ask(max_tokens: int) -> GenerationRequest:
        return GenerationRequest(
            kind="completion",
            sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
            cache=cache,
            prompt="hello there",
        )

    with serving(worker_for(loaded)) as worker:
        failed = complete(worker, ask(10 * loaded.context_length))
        done = complete(worker, ask(2))
        deadline = time.monotonic() + 10  # the record closes just after its last event
        while len(history := worker.snapshot()["history"]) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert isinstance(failed, Failed) and isinstance(done, Finished)
    newest, oldest = history
    assert oldest["state"] == "error"
    assert (
        oldest["error"] == f"invalid_request: {failed.message}" and "max_tokens" in oldest["error"]
    )
    assert newest["state"] == "done" and newest["error"] is None
