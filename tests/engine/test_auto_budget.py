"""``--budget auto``: a request that sends no budget keeps every row while its full cache
fits ``max_kv_bytes`` (answering exactly as the full cache), and beyond is evicted to what
fits its share, with a recent window; ``kv_cache`` says what ran and why."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from types import SimpleNamespace

import pytest

from qfserve.engine.kv.config import CacheConfig, default_recent
from qfserve.engine.kv.kvzap import KVzapPolicy
from qfserve.engine.kv.memory import kv_need, kv_row_bytes
from qfserve.engine.kv.methods import MethodContext
from qfserve.engine.models.loading import load_model
from qfserve.engine.serving.admission import MIN_AUTO_BUDGET, resolve_auto
from qfserve.engine.serving.config import EngineConfig, request_cache
from qfserve.engine.serving.startup import pick_method
from qfserve.engine.text.requests import Failed, Finished, GenerationRequest, SamplingParams
from tests.workers import serving, worker_for

FALLBACK = "qfilters"  # the method --kv-method auto evicts with where a model has no surrogates
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
    kept = resolve_auto(loaded, template, auto, prompt, MAX_TOKENS, EngineConfig(), need, FALLBACK)
    assert kept.method == "full" and kept.budget == prompt + MAX_TOKENS
    # One byte short: evicted, to the largest budget the share holds (at least 512 rows
    # where the whole memory holds them), with a quarter of it recent.
    row = kv_row_bytes(loaded.model, loaded.config, template)
    cut = resolve_auto(
        loaded, template, auto, prompt, MAX_TOKENS, EngineConfig(), need - 1, FALLBACK
    )
    assert cut.method == template.method
    assert cut.budget == min((need - 1) // row - 1, MIN_AUTO_BUDGET) == MIN_AUTO_BUDGET
    assert cut.recent == MIN_AUTO_BUDGET // 4 and cut.chunk == 8
    small = 300 * row
    one = EngineConfig(max_batch=1)
    cut = resolve_auto(loaded, template, auto, prompt, MAX_TOKENS, one, small, FALLBACK)
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


def test_the_server_picks_kvzap_where_it_evicts_on_its_own(loaded):
    """``--kv-method auto`` (the default): a request that sends neither method nor budget,
    evicted because its full cache is past the memory, runs the method the worker picked
    for the model (kvzap where it has surrogates), its layers sharing the rows, at the
    largest budget whose reservation (``budget`` rows a head on average and a prefill chunk)
    fits; a request that sends a budget, or a server whose method is set, keeps its own."""
    config = EngineConfig()
    template, _, auto = request_cache(config, {})
    assert auto is not None and auto.method and template.method == FALLBACK
    assert request_cache(config, {"budget": 64})[0].method == FALLBACK
    pinned = request_cache(EngineConfig(kv_method="qfilters"), {})[2]
    assert pinned is not None and not pinned.method
    prompt, one = 1_000, EngineConfig(max_batch=1)
    kvzap = CacheConfig(method="kvzap", budget=64, budget_mode="global")
    rows = 700
    small = rows * kv_row_bytes(loaded.model, loaded.config, kvzap)
    cut = resolve_auto(loaded, template, auto, prompt, MAX_TOKENS, one, small, "kvzap")
    assert (cut.method, cut.budget_mode, cut.chunk) == ("kvzap", "global", 1)
    # rows - 1 (the decode step's slot) >= budget + prefill chunk + 1, at the most
    assert cut.budget == rows - 1 - one.prefill_chunk - 1
    assert cut.recent == default_recent(cut.budget, cut.n_sink)
    policy = KVzapPolicy(cut, [], MethodContext(loaded.model, loaded.tokenizer))

    def need(budget: int) -> int:
        return (
            KVzapPolicy(dataclasses.replace(cut, budget=budget), [], policy.context)
            .reserve(
                loaded,
                prompt,
                MAX_TOKENS,
                max_kv_bytes=small,
                prefill_chunk=one.prefill_chunk,
                kept=False,
            )
            .need
        )

    assert need(cut.budget) <= small < need(cut.budget + 1)
    # A budget mode sent is kept: per head, the plain reservation.
    template, _, auto = request_cache(config, {"budget_mode": "per_head"})
    cut = resolve_auto(loaded, template, auto, prompt, MAX_TOKENS, one, small, "kvzap")
    assert (cut.method, cut.budget_mode, cut.budget) == ("kvzap", "per_head", rows - 1)


def test_the_pick_follows_the_model_and_its_ranks(caplog):
    """kvzap where the model has surrogates and runs on one rank (its shared rows span the
    KV heads that ranks split), else Q-Filters; a method set on the server is kept."""
    has, lacks = SimpleNamespace(kvzap=object()), SimpleNamespace(kvzap=None)
    auto = EngineConfig()
    with caplog.at_level(logging.INFO, logger="qfserve.engine.serving.startup"):
        assert pick_method(auto, has, None) == "kvzap"
    assert "evict with kvzap (the model has KVzap surrogates)" in caplog.text
    assert pick_method(auto, lacks, None) == FALLBACK
    assert pick_method(auto, has, SimpleNamespace(size=2)) == FALLBACK
    assert pick_method(EngineConfig(kv_method="knorm"), has, None) == "knorm"


def test_a_request_past_the_memory_is_evicted_and_says_so(loaded):
    template = request_cache(EngineConfig(), {})[0]
    row = kv_row_bytes(loaded.model, loaded.config, template)
    config = EngineConfig(max_kv_bytes=300 * row, max_batch=1, kv_method="qfilters")
    kv = run(loaded, config)[1].kv_cache
    assert kv["budget_source"] == "auto" and kv["method"] == "qfilters"
    assert kv["budget"] == 299 and kv["recent"] == 74
    assert kv["evictions"] > 0 and kv["tokens_kept"] < kv["tokens_seen"]
    # What the request sent still applies.
    kv = run(loaded, config, recent=10, method="knorm")[1].kv_cache
    assert (kv["method"], kv["budget"], kv["recent"]) == ("knorm", 299, 10)
    # The server's own pick (the default --kv-method auto; the test model ships KVzap
    # surrogates): kvzap, its layers sharing the rows, to the budget its reservation fits.
    kvzap = CacheConfig(method="kvzap", budget=64, budget_mode="global")
    rows = 700  # under the prompt's ~1.7k tokens
    small = rows * kv_row_bytes(loaded.model, loaded.config, kvzap)
    auto = EngineConfig(max_kv_bytes=small, max_batch=1)
    kv = run(loaded, auto)[1].kv_cache
    assert (kv["method"], kv["budget_mode"], kv["budget_source"]) == ("kvzap", "global", "auto")
    assert kv["budget"] == rows - 2 - auto.prefill_chunk
    assert kv["evictions"] > 0 and kv["tokens_kept"] < kv["tokens_seen"]
