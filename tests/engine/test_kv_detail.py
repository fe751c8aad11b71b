"""``kv_cache_detail`` against the rows the caches really hold.

The reference does not trust the caches' own position bookkeeping: every key row a cache is
handed is stamped with its absolute position in its first component (at the eviction cache
for prompt blocks and steps alone, at the batch cache for packed decode steps), so when a
request ends the position of each kept row is read off the row itself. The detail's counts
must equal that count over layers and KV heads, for several methods, with and without chunks
and adaptive budgets, alone and in a packed batch. Keeping positions must not change what is
kept: the same request with and without the detail gives the same tokens.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from qfserve.engine.kv.batch import BatchCache
from qfserve.engine.kv.cache import EvictionCache
from qfserve.engine.kv.config import CacheConfig, ConfigError
from qfserve.engine.models.loading import default_model_path, load_model
from qfserve.engine.serving import scheduler
from qfserve.engine.serving.detail import runs, text_runs, token_ends
from qfserve.engine.text.requests import Failed, Finished, GenerationRequest, SamplingParams
from tests.workers import complete, final_event, serving, worker_for

SETTINGS = [
    CacheConfig(method="qfilters", budget=48, recent=8),
    CacheConfig(method="qfilters", budget=64, recent=16, chunk=8),
    CacheConfig(method="qfilters", budget=56, recent=8, budget_mode="adaptive", floor=0.25),
    CacheConfig(method="knorm", budget=40, recent=8, chunk=4),
    CacheConfig(method="streaming", budget=48, recent=0, n_sink=4),
    CacheConfig(method="tova", budget=44, recent=8),
    CacheConfig(method="snapkv", budget=52, recent=8),
]
TEXT = "A lantern hung by the mill and the miller kept the code 7719 in a tin by the door"
WORDS = TEXT.split()


@pytest.fixture(scope="module")
def loaded():
    return load_model(str(default_model_path()))


def text_of(i: int) -> str:
    return " ".join(WORDS[(i + k) % len(WORDS)] for k in range(50 + 37 * i))


def request(i: int, config: CacheConfig, *, detail: bool = True) -> GenerationRequest:
    return GenerationRequest(
        kind="completion",
        prompt=text_of(i),
        sampling=SamplingParams(max_tokens=12, temperature=0.0),
        cache=replace(config, positions=detail),
        reuse=False,
        detail=detail,
    )


def _stamp(keys: mx.array, first: mx.array) -> mx.array:
    """``keys`` ``(B, H, N, D)`` with component 0 of row ``n`` set to ``first[b] + n``."""
    B, H, N, _ = keys.shape
    at = (first.reshape(B, 1, 1) + mx.arange(N).reshape(1, 1, N)).astype(keys.dtype)
    return mx.concatenate([mx.broadcast_to(at[..., None], (B, H, N, 1)), keys[..., 1:]], axis=-1)


@pytest.fixture
def stamped(monkeypatch) -> list[tuple[list[int], list[int]]]:
    """Stamp every row with its position; record (detail counts, counts read off the rows)
    for each request that reports its detail."""
    alone, batched = EvictionCache.update_and_fetch, BatchCache.update_and_fetch

    def alone_stamp(self, keys, values):
        return alone(self, _stamp(keys, mx.array([self.offset])), values)

    def batch_stamp(self, keys, values):
        first = mx.array([m.offset for m in self.members])
        return batched(self, _stamp(keys, first), values)

    monkeypatch.setattr(EvictionCache, "update_and_fetch", alone_stamp)
    monkeypatch.setattr(BatchCache, "update_and_fetch", batch_stamp)
    seen: list[tuple[list[int], list[int]]] = []
    real = scheduler.kv_cache_detail

    def spy(caches, prompt, tokenizer, req):
        detail = real(caches, prompt, tokenizer, req)
        seen.append((decode(detail["kept"]), read_off_rows(caches, len(prompt))))
        return detail

    monkeypatch.setattr(scheduler, "kv_cache_detail", spy)
    return seen


def decode(kept: list[list[int]]) -> list[int]:
    return [value for value, n in kept for _ in range(n)]


def read_off_rows(caches: list[Any], n: int) -> list[int]:
    """Per prompt position, the (layer, head) rows whose stamp says they are it."""
    counts = np.zeros(n, dtype=np.int64)
    for cache in caches:
        assert isinstance(cache, EvictionCache)
        keys, _, _ = cache.kept()  # temporal order; ragged heads: each head's rows first
        stamps = np.array(keys[0, :, :, 0].astype(mx.float32)).round().astype(np.int64)
        H, S = stamps.shape
        real = np.ones((H, S), dtype=bool)
        if cache.valid is not None:
            per_head = np.array(cache.valid[0].sum(axis=-1)) - (cache.free is not None)
            real = np.arange(S)[None, :] < per_head[:, None]
        for h in range(H):
            held = stamps[h][real[h]]
            assert len(set(held.tolist())) == held.size, "a position held twice in one head"
            counts += np.bincount(held[held < n], minlength=n)[:n]
    return counts.tolist()


@pytest.mark.parametrize("config", SETTINGS, ids=lambda c: f"{c.method}-{c.chunk}-{c.budget_mode}")
def test_alone_the_counts_are_the_rows_the_caches_hold(loaded, stamped, config):
    with serving(worker_for(loaded, max_batch=1)) as worker:
        event = complete(worker, request(2, config))
    assert isinstance(event, Finished) and event.kv_detail is not None, event
    ((counts, reference),) = stamped
    assert counts == reference
    detail = event.kv_detail
    assert detail["tokens"] == len(counts) == event.prompt_tokens
    config_ = loaded.config
    assert detail["layer_heads"] == config_["num_hidden_layers"] * config_["num_key_value_heads"]
    assert max(counts) <= detail["layer_heads"]
    assert 0 < sum(counts) < len(counts) * detail["layer_heads"], "the budget dropped rows"


def test_in_a_packed_batch_the_counts_are_the_rows_the_caches_hold(loaded, stamped, monkeypatch):
    from qfserve.engine.kv.batch import packed

    steps = []
    step = packed.PackedBatch.step
    monkeypatch.setattr(
        packed.PackedBatch, "step", lambda self, k, v: steps.append(1) or step(self, k, v)
    )
    configs = [SETTINGS[0], SETTINGS[1], SETTINGS[3], SETTINGS[4]]  # the packable ones
    requests = [request(i, c) for i, c in enumerate(configs)]

    async def go(worker):
        loop = asyncio.get_running_loop()
        jobs = [worker.submit(r, loop) for r in requests]
        return await asyncio.wait_for(asyncio.gather(*(final_event(j) for j in jobs)), 300)

    with serving(worker_for(loaded, max_batch=8)) as worker:
        events = asyncio.run(go(worker))
    assert steps, "the batch was never packed"
    assert all(isinstance(e, Finished) and e.kv_detail for e in events)
    assert len(stamped) == len(configs)
    for counts, reference in stamped:
        assert counts == reference


@pytest.fixture
def rows_at_the_end(monkeypatch) -> list[list[int]]:
    """For every request that ends (detail asked or not), the stamped rows its caches hold."""
    seen: list[list[int]] = []
    detailed = scheduler.Scheduler._detailed

    def spy(self, seq, done):
        seen.append(read_off_rows(seq.caches, len(seq.prompt)))
        return detailed(self, seq, done)

    monkeypatch.setattr(scheduler.Scheduler, "_detailed", spy)
    return seen


@pytest.mark.parametrize("config", SETTINGS, ids=lambda c: f"{c.method}-{c.chunk}-{c.budget_mode}")
def test_keeping_positions_keeps_the_same_rows(loaded, stamped, rows_at_the_end, config):
    """The detail's bookkeeping must not change what is kept: the same rows, read off the
    rows themselves, with and without it."""
    with serving(worker_for(loaded, max_batch=1)) as worker:
        for detail in (True, False):
            assert isinstance(complete(worker, request(4, config, detail=detail)), Finished)
    with_detail, without = rows_at_the_end
    assert with_detail == without


def test_a_batch_mixing_tracked_and_untracked_members_keeps_the_same_rows(
    loaded, stamped, rows_at_the_end
):
    """Packed together, a member keeping positions and one not each keep what they keep
    alone with the detail off."""
    configs = [SETTINGS[0], SETTINGS[3], SETTINGS[4], SETTINGS[0]]
    mixed = [request(i, c, detail=i % 2 == 0) for i, c in enumerate(configs)]

    async def go(worker, requests):
        loop = asyncio.get_running_loop()
        jobs = [worker.submit(r, loop) for r in requests]
        return await asyncio.wait_for(asyncio.gather(*(final_event(j) for j in jobs)), 300)

    with serving(worker_for(loaded, max_batch=8)) as worker:
        asyncio.run(go(worker, mixed))
    batched = sorted(rows_at_the_end)
    rows_at_the_end.clear()
    with serving(worker_for(loaded, max_batch=1)) as worker:
        for i, c in enumerate(configs):
            complete(worker, request(i, c, detail=False))
    assert batched == sorted(rows_at_the_end)
    for counts, reference in stamped:
        assert counts == reference


@pytest.mark.parametrize("config", [SETTINGS[0], SETTINGS[2], SETTINGS[5]], ids=str)
def test_a_second_turn_on_kept_caches_reports_the_rows_they_hold(
    loaded, stamped, monkeypatch, config
):
    """Turn 2 continues turn 1's caches (decoded in the slot layout, then a new block): its
    detail against the rows."""
    seen: list[list[int]] = []
    detailed = scheduler.Scheduler._detailed

    def spy(self, seq, done):
        seen.append([*seq.prompt, *seq.generated])
        return detailed(self, seq, done)

    monkeypatch.setattr(scheduler.Scheduler, "_detailed", spy)
    prompt = tuple(loaded.tokenizer.encode(text_of(2)))
    first = replace(request(2, config), prompt=prompt, reuse=True)
    more = tuple(loaded.tokenizer.encode(" and then the fox ran home" * 6))
    with serving(worker_for(loaded, max_batch=1)) as worker:
        assert isinstance(complete(worker, first), Finished)
        second = replace(first, prompt=(*seen[0], *more))
        two = complete(worker, second)
    assert isinstance(two, Finished) and two.kv_detail is not None
    assert two.cached_tokens > len(prompt), "turn 2 did not continue turn 1's caches"
    assert len(stamped) == 2
    for counts, reference in stamped:
        assert counts == reference


def test_the_text_runs_cover_each_character_with_its_tokens_count(loaded):
    """Per character, the count of the token whose text holds it (reference: decoding each
    prefix of the prompt with the tokenizer itself)."""
    tokenizer = loaded.tokenizer
    content = text_of(1)
    prompt = tokenizer.encode(content)
    counts = np.arange(len(prompt)) % 5
    text, ends = token_ends(tokenizer, prompt)
    (found,) = text_runs(counts, text, ends, [content])
    assert found is not None and sum(n for _, n in found) == len(content)
    per_char = [v for v, n in found for _ in range(n)]
    start = text.find(content)
    reference_ends = [len(tokenizer.decode(prompt[: i + 1])) for i in range(len(prompt))]
    for x, value in enumerate(per_char):
        token = next(i for i, end in enumerate(reference_ends) if end > start + x)
        assert value == counts[token], (x, content[x])
    assert text_runs(counts, text, ends, ["not in the prompt", None]) == [None, None]


def test_a_message_is_found_after_its_role_not_in_the_template_around_it(loaded):
    """A user message saying "user" is its own text, not the template's role header."""
    tokenizer = loaded.tokenizer
    messages = [{"role": "user", "content": "user"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    text, ends = token_ends(tokenizer, prompt)
    counts = np.arange(len(prompt))
    (found,) = text_runs(counts, text, ends, ["user"], ["user"])
    first_user = text.find("user")
    assert found is not None and text.find("user", first_user + 4) > first_user
    token = next(i for i, end in enumerate(ends) if end > text.find("user", first_user + 4))
    assert found[0][0] == counts[token]


def test_runs_merge_equal_neighbours_and_skip_empty_lengths():
    assert runs([3, 3, 1, 1, 1, 3]) == [[3, 2], [1, 3], [3, 1]]
    assert runs([2, 5, 2], [4, 0, 1]) == [[2, 5]]
    assert runs([]) == []


def test_the_detail_stays_within_its_cap_and_is_refused_beyond_it(loaded):
    config = SETTINGS[1]
    with serving(worker_for(loaded, max_batch=1, kv_detail_max_tokens=400)) as worker:
        small = complete(worker, request(2, config))
        big = complete(worker, request(12, config))
    assert isinstance(small, Finished) and small.kv_detail is not None
    # At most two integers per prompt token in the runs, per message at most two per token.
    size = len(json.dumps(small.kv_detail))
    assert size <= 16 * small.prompt_tokens + 200, size
    assert isinstance(big, Failed) and big.param == "kv_cache_detail", big
    assert "--kv-detail-max-tokens 400" in big.message


def test_a_full_cache_has_nothing_to_report():
    with pytest.raises(ConfigError) as err:
        CacheConfig(method="full", positions=True)
    assert err.value.param == "positions"


@pytest.mark.parametrize("keep", [0, 4])
def test_a_sliding_window_layer_holds_what_its_rows_say(keep):
    """mlx-lm's rotating cache (Gemma 3's sliding layers) after a prompt block and decode
    steps: the positions counted are the stamps its buffer holds."""
    from mlx_lm.models.cache import RotatingKVCache

    from qfserve.engine.kv.held import held_counts

    cache = RotatingKVCache(max_size=16, keep=keep)
    for n in (40, *([1] * 7)):
        keys = _stamp(mx.zeros((1, 2, n, 8)), mx.array([cache.offset]))
        cache.update_and_fetch(keys, mx.zeros((1, 2, n, 8)))
    stamps = np.array(cache.keys[0, :, :, 0]).round().astype(np.int64)  # (H, max_size)
    reference = np.zeros(cache.offset, dtype=np.int64)
    for head in stamps:
        reference += np.bincount(head, minlength=cache.offset)
    counts, pairs = held_counts([cache], cache.offset)
    assert pairs == 2
    assert counts.tolist() == reference.tolist()
