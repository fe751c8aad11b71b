"""``--budget auto``: a request that sends no budget keeps every row while its full cache
fits ``max_kv_bytes`` (answering exactly as the full cache), and beyond is evicted to what
fits its share, with a recent window; ``kv_cache`` says what ran and why."""

from __future__ import annotations

import asyncio

import pytest

from qfserve.engine.kv.config import CacheConfig, default_recent
from qfserve.engine.kv.memory import kv_need, kv_row_bytes
from qfserve.engine.models.loading import load_model
from qfserve.engine.serving.admission import MIN_AUTO_BUDGET, resolve_auto
from qfserve.engine.serving.config import EngineConfig, request_cache
from qfserve.engine.text.requests import Failed, Finished, GenerationRequest, SamplingParams
from tests.workers import serving, worker_for

PROMPT = " ".join(f"item {i} costs {i * 7 % 100} coins." for i in range(120))
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def loaded():
    return load_model("qfserve-tiny")


def request(config: EngineConfig, **sent) -> GenerationRequest:
    cache, source, auto = request_cache(config, sent)
    return GenerationRequest(
        kind="completion",
        sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        cache=cache,
        prompt=PROMPT,
        budget_source=source,
        auto=auto,
        reuse=False,
    )


def run(loaded, config: EngineConfig, **sent) -> tuple[str, Finished]:
    """The greedy completion's text and its ``Finished`` event."""

    async def go(worker) -> tuple[str, Finished]:
        job = worker.submit(request(config, **sent), asyncio.get_running_loop())
        text = ""
        while not isinstance(event := await job.next_event(), (Finished, Failed)):
            text += getattr(event, "text", "")
        assert isinstance(event, Finished), event
        return text, event

    with serving(worker_for(loaded, **_worker_fields(config))) as worker:
        return asyncio.run(asyncio.wait_for(go(worker), 120))


def _worker_fields(config: EngineConfig) -> dict:
    return {"max_kv_bytes": config.max_kv_bytes, "max_batch": config.max_batch}


def test_sources_of_the_budget():
    auto = EngineConfig()
    assert auto.budget == "auto" and request_cache(auto, {})[1] == "auto"
    assert request_cache(auto, {"budget": 64})[1:] == ("request", None)
    cache, source, _ = request_cache(EngineConfig(budget=256), {})
    assert source == "server" and cache.budget == 256
    # An explicit budget given no recent window gets a quarter of it.
    assert cache.recent == 64 == default_recent(256, cache.n_sink)
    assert request_cache(auto, {"budget": 64, "recent": 0})[0].recent == 0
    assert EngineConfig(budget="512").budget == 512  # as the command line and env give it


def test_resolution_by_memory(loaded):
    template, _, auto = request_cache(EngineConfig(), {})
    prompt = 1_000
    full = CacheConfig(method="full", budget=prompt + MAX_TOKENS)
    need = kv_need(loaded, full, prompt, MAX_TOKENS)
    kept = resolve_auto(loaded, template, auto, prompt, MAX_TOKENS, EngineConfig(), need)
    assert kept.method == "full" and kept.budget == prompt + MAX_TOKENS
    # One byte short: evicted, to the largest budget the share holds (at least 512 rows
    # where the whole memory holds them), with a quarter of it recent.
    row = kv_row_bytes(loaded.model, loaded.config, template)
    cut = resolve_auto(loaded, template, auto, prompt, MAX_TOKENS, EngineConfig(), need - 1)
    assert cut.method == template.method
    assert cut.budget == min((need - 1) // row - 1, MIN_AUTO_BUDGET) == MIN_AUTO_BUDGET
    assert cut.recent == MIN_AUTO_BUDGET // 4 and cut.chunk == 8
    small = 300 * row
    cut = resolve_auto(loaded, template, auto, prompt, MAX_TOKENS, EngineConfig(max_batch=1), small)
    assert cut.budget == 299 and cut.recent == 74 and cut.chunk == 8
    assert kv_need(loaded, cut, prompt, MAX_TOKENS) <= small


def test_a_request_that_fits_answers_as_the_full_cache(loaded):
    config = EngineConfig(max_kv_bytes=2**30)
    text, auto = run(loaded, config)
    full_text, _ = run(loaded, config, method="full")
    evicted_text, evicted = run(loaded, config, budget=64)
    assert auto.kv_cache["method"] == "full" and auto.kv_cache["budget_source"] == "auto"
    assert auto.kv_cache["evictions"] == 0
    assert auto.kv_cache["tokens_kept"] == auto.kv_cache["tokens_seen"] > 400
    assert text == full_text and len(text) > 0
    assert evicted.kv_cache["evictions"] > 0  # the control: eviction changes this answer
    assert evicted_text != full_text


def test_a_request_past_the_memory_is_evicted_and_says_so(loaded):
    template = request_cache(EngineConfig(), {})[0]
    row = kv_row_bytes(loaded.model, loaded.config, template)
    config = EngineConfig(max_kv_bytes=300 * row, max_batch=1)
    kv = run(loaded, config)[1].kv_cache
    assert kv["budget_source"] == "auto" and kv["method"] == "qfilters"
    assert kv["budget"] == 299 and kv["recent"] == 74
    assert kv["evictions"] > 0 and kv["tokens_kept"] < kv["tokens_seen"]
    # What the request sent still applies.
    kv = run(loaded, config, recent=10, method="knorm")[1].kv_cache
    assert (kv["method"], kv["budget"], kv["recent"]) == ("knorm", 299, 10)
