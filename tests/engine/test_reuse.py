"""Multi-turn reuse of finished requests' caches, against requests that rebuild them.

Turn ``k``'s prompt is turn ``k-1``'s prompt, what turn ``k-1`` generated and a new user
part, as token ids, so the cached token list is an exact prefix. References: the same
conversation with reuse off, and (under eviction) the same cache objects continued by hand
through mlx-lm's ``stream_generate``.
"""

from __future__ import annotations

import asyncio
from dataclasses import astuple, replace

import pytest
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler

from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.models.loading import default_model_path, load_model
from qfserve.engine.reuse.disk import settings_of
from qfserve.engine.serving.config import DEFAULT_PREFILL_CHUNK
from qfserve.engine.text.requests import Delta, Failed, Finished, GenerationRequest, SamplingParams
from tests.workers import serving, worker_for

TURN_TOKENS = 12


@pytest.fixture(scope="module")
def loaded():
    return load_model(str(default_model_path()))


@pytest.fixture(scope="module")
def worker(loaded):
    with serving(worker_for(loaded, prompt_cache_size=64)) as w:
        yield w


def ask(worker, req: GenerationRequest) -> tuple[list[str], Finished]:
    """One request; the generated tokens' text pieces and its ``Finished``."""

    async def go():
        job = worker.submit(req, asyncio.get_running_loop())
        pieces = []
        while True:
            event = await job.next_event()
            if isinstance(event, Delta):
                pieces.extend(lp.token for lp in event.logprobs)
            elif isinstance(event, Failed):
                raise AssertionError(event)
            elif isinstance(event, Finished):
                return pieces, event

    return asyncio.run(asyncio.wait_for(go(), 120))


def user_part(loaded, k: int) -> list[int]:
    return loaded.tokenizer.encode(f" and then turn {k} asks about the fox and the box number {k}")


def request(prompt: list[int], config: CacheConfig, *, reuse: bool = True) -> GenerationRequest:
    return GenerationRequest(
        kind="completion",
        prompt=tuple(prompt),
        sampling=SamplingParams(max_tokens=TURN_TOKENS, temperature=0.0, logprobs=True),
        cache=config,
        reuse=reuse,
    )


OPENING = "the pass key is 4821 remember it"


def conversation(
    worker, loaded, config: CacheConfig, turns: int, *, reuse: bool, opening: str = OPENING
):
    """Every turn's generated token ids and ``Finished``."""
    vocab = {loaded.tokenizer.decode([i]): i for i in range(len(loaded.tokenizer.vocab))}
    prompt = loaded.tokenizer.encode(opening)
    out = []
    for k in range(turns):
        pieces, final = ask(worker, request(prompt, config, reuse=reuse))
        ids = [vocab[p] for p in pieces]
        out.append((ids, final))
        prompt = [*prompt, *ids, *user_part(loaded, k)]
    return out


@pytest.mark.parametrize("method", ["full", "streaming", "knorm", "qfilters", "kvzip", "kvzap"])
def test_reuse_under_the_budget_changes_no_token(worker, loaded, method):
    config = CacheConfig(method=method, budget=1024, recent=16)
    fresh = conversation(worker, loaded, config, 5, reuse=False)
    reused = conversation(worker, loaded, config, 5, reuse=True)
    assert [ids for ids, _ in reused] == [ids for ids, _ in fresh]
    assert [f.cached_tokens for _, f in fresh] == [0] * 5
    cached = [f.cached_tokens for _, f in reused]
    assert cached[0] == 0 and all(c > 0 for c in cached[1:])
    # Each turn continues the previous one's caches: prompt and generated tokens.
    for (_, before), (_, after) in zip(reused, reused[1:], strict=False):
        assert after.cached_tokens == before.prompt_tokens + before.completion_tokens


@pytest.mark.parametrize(
    "config",
    [
        CacheConfig(method="qfilters", budget=48, recent=8),
        # kvzap bounded by a threshold too (above most scores: fewer rows than the budget)
        CacheConfig(method="kvzap", budget=48, recent=8, threshold=-2.0),
    ],
    ids=["qfilters", "kvzap-threshold"],
)
def test_a_reused_evicted_cache_continues_like_the_same_caches_by_hand(worker, loaded, config):
    opening = " ".join([OPENING] * 10)  # longer than the budget: turn 1 evicts
    (ids1, first), (ids2, second) = conversation(
        worker, loaded, config, 2, reuse=True, opening=opening
    )
    assert first.kv_cache["evictions"] > 0 and second.cached_tokens > 0
    prompt1 = loaded.tokenizer.encode(opening)
    caches = worker.calibration.caches_for(config)

    def feed(tokens: list[int]) -> list[int]:
        return [
            g.token
            for g in stream_generate(
                loaded.model,
                loaded.tokenizer,
                tokens,
                max_tokens=TURN_TOKENS,
                sampler=make_sampler(0.0),
                prompt_cache=caches,
                prefill_step_size=DEFAULT_PREFILL_CHUNK,
            )
        ]

    assert feed(prompt1) == ids1
    assert feed(user_part(loaded, 0)) == ids2  # the caches already hold turn 1 and its answer


def test_a_prompt_that_differs_from_what_was_generated_is_a_counted_miss(worker, loaded):
    config = CacheConfig(method="knorm", budget=40, recent=8)
    prompt = loaded.tokenizer.encode(" ".join(["pack my box with five dozen liquor jugs"] * 8))
    pieces, first = ask(worker, request(prompt, config))
    assert first.kv_cache["evictions"] > 0
    vocab = {loaded.tokenizer.decode([i]): i for i in range(len(loaded.tokenizer.vocab))}
    ids = [vocab[p] for p in pieces]
    edited = [*prompt, *ids[:-1], (ids[-1] + 1) % len(vocab), *user_part(loaded, 7)]
    misses = worker.snapshot()["prompt_cache"]["misses"]
    _, second = ask(worker, request(edited, config))
    assert second.cached_tokens == 0
    assert worker.snapshot()["prompt_cache"]["misses"] == misses + 1
    entries = worker.snapshot()["prompt_cache"]["entries"]
    assert any(e["settings"]["method"] == "knorm" and e["tokens"] > 0 for e in entries)
    assert all("prompt" not in e for e in entries)  # counts and settings only


def test_a_named_conversation_continues_only_caches_kept_under_its_name(worker, loaded):
    """``cache_name`` (``prompt_cache_key``) is part of what a kept cache must match: the
    same prefix under another name, or under none, is a fresh prefill."""
    config = CacheConfig(method="qfilters", budget=1000, recent=12)  # no other test's settings
    vocab = {loaded.tokenizer.decode([i]): i for i in range(len(loaded.tokenizer.vocab))}
    prompt = loaded.tokenizer.encode("a named conversation: the pass key is 7305")

    def named(tokens: list[int], name: str | None) -> GenerationRequest:
        return replace(request(tokens, config), cache_name=name)

    pieces, one = ask(worker, named(prompt, "alice"))
    turn2 = [*prompt, *(vocab[p] for p in pieces), *user_part(loaded, 0)]
    assert ask(worker, named(turn2, "bob"))[1].cached_tokens == 0
    assert ask(worker, named(turn2, None))[1].cached_tokens == 0
    _, two = ask(worker, named(turn2, "alice"))
    assert two.cached_tokens == one.prompt_tokens + one.completion_tokens


def test_a_full_caches_key_is_its_method_whatever_its_budget():
    """An ``auto`` budget resolves to ``full`` with a budget of each turn's own length: a
    later turn must still continue the last one's full cache."""
    from qfserve.engine.reuse.kept import cache_key

    def key(config: CacheConfig, name: str | None = None) -> tuple:
        return cache_key("m", config, "calibrated", name)

    turn1, turn2 = CacheConfig(method="full", budget=38), CacheConfig(method="full", budget=61)
    assert key(turn1) == key(turn2) != key(turn2, "alice")
    evicting = CacheConfig(method="qfilters", budget=38)
    assert key(evicting) != key(replace(evicting, budget=61))


def test_saved_entries_keep_their_name_and_old_files_read_as_unnamed(loaded, tmp_path):
    import json

    import mlx.core as mx

    from qfserve.engine.reuse import disk as persist
    from qfserve.engine.reuse.kept import cache_key

    config = CacheConfig(method="knorm", budget=64, recent=8)

    def fresh(cfg: CacheConfig) -> list:
        return make_caches(loaded.model, cfg)

    caches = fresh(config)
    tokens = loaded.tokenizer.encode("kept under a name")
    loaded.model(mx.array(tokens)[None], cache=caches)
    mx.eval([c.state for c in caches])
    key = cache_key("tiny", config, "none", "alice")
    path = persist.save(tmp_path, key, tokens, caches, "fp")
    assert persist.load(path, "fp", fresh)[0] == key
    # A file written before keys named their conversation (format 1: no name in the key).
    arrays, meta = mx.load(str(path), return_metadata=True)
    header = json.loads(meta["qfserve"])
    header.update(format=1, key=header["key"][:-1])
    old = tmp_path / ("1" * 20 + persist.SUFFIX)
    mx.save_safetensors(str(old), arrays, {"qfserve": json.dumps(header)})
    assert persist.load(old, "fp", fresh)[0] == cache_key("tiny", config, "none")


@pytest.mark.parametrize("method", ["qfilters", "kvzip", "kvzap"])
def test_saved_caches_survive_a_restart(loaded, tmp_path, caplog, method):
    from qfserve.engine.reuse import disk as persist

    def started(ld):
        return serving(worker_for(ld, prompt_cache_dir=str(tmp_path)))

    config = CacheConfig(method=method, budget=48, recent=8)
    opening = " ".join([OPENING] * 10)
    with started(loaded) as first:
        (ids1, one), (ids2, two) = conversation(
            first, loaded, config, 2, reuse=True, opening=opening
        )
    assert two.cached_tokens > 0
    if method == "kvzip":  # turn one answered on its full cache, then was kept compressed
        assert one.kv_cache["evictions"] == 0
        assert two.kv_cache["tokens_kept"] < two.prompt_tokens + two.completion_tokens
    else:
        assert one.kv_cache["evictions"] > 0
    saved = sorted(tmp_path.glob("*" + persist.SUFFIX))
    assert len(saved) == 2  # both turns' caches
    # Another model's file in the same folder is skipped, not loaded.
    other = tmp_path / ("0" * 20 + persist.SUFFIX)
    fingerprint = first.calibration.fingerprint.encode()
    other.write_bytes(saved[0].read_bytes().replace(fingerprint, b"f" * len(fingerprint)))
    with started(loaded) as second:
        assert len(second.prompt_cache.kept) == 2
        prompt1 = loaded.tokenizer.encode(opening)
        vocab = {loaded.tokenizer.decode([i]): i for i in range(len(loaded.tokenizer.vocab))}
        first_ids = [vocab[p] for p in ask(second, request(prompt1, config, reuse=False))[0]]
        if method == "kvzip":  # reuse off compresses the prompt; turn one answered in full
            first_ids = ids1
        prompt2 = [*prompt1, *first_ids, *user_part(loaded, 0)]
        pieces, again = ask(second, request(prompt2, config))
    assert again.cached_tokens == two.cached_tokens  # turn one's cache, read back from disk
    assert [vocab[p] for p in pieces] == ids2
    assert any("skipping saved cache" in r.message and other.name in r.message
               for r in caplog.records)  # fmt: skip
    assert other.exists()  # another server's file is left alone


def test_a_cache_that_cannot_be_saved_never_stops_the_worker(loaded, tmp_path, monkeypatch):
    from qfserve.engine.reuse import disk as persist

    def broken(*args, **kwargs):
        raise RuntimeError("disk says no")

    monkeypatch.setattr(persist, "save", broken)
    with serving(worker_for(loaded, prompt_cache_dir=str(tmp_path))) as w:
        config = CacheConfig(method="knorm", budget=40, recent=8)
        prompt = loaded.tokenizer.encode(" ".join([OPENING] * 8))
        for _ in range(2):  # the second request is served after the first one's save failed
            _, final = ask(w, request(prompt, config))
            assert final.completion_tokens > 0
        assert w.alive() and w.ready


@pytest.mark.parametrize("method", ["tova", "snapkv"])
def test_a_reused_query_aware_cache_reads_the_queries_the_model_computes_now(
    worker, loaded, method
):
    """A reused cache is a deep copy; its scorer must keep reading the layer's installed
    query tap, not a detached copy of it. Before, a reused TOVA cache decoding in a batch with
    another request read the copy's stale single-row queries and the step failed for both."""
    import copy

    config = CacheConfig(method=method, budget=96, recent=8)
    caches = make_caches(loaded.model, config)
    twin = copy.deepcopy(caches)
    assert all(a.scorer.tap is b.scorer.tap for a, b in zip(caches, twin, strict=True))

    prompt = loaded.tokenizer.encode(f"{OPENING} and the {method} cache holds it")
    alone, first = ask(worker, request(prompt, config))  # kept: it never evicted (trimmable)
    assert first.prompt_tokens + first.completion_tokens < config.budget
    partner = replace(
        request(
            loaded.tokenizer.encode("once upon a time"), CacheConfig(method="qfilters", budget=64)
        ),
        sampling=SamplingParams(max_tokens=40, temperature=0.0),
    )

    async def go():
        loop = asyncio.get_running_loop()
        other = worker.submit(partner, loop)
        while not isinstance(await other.next_event(), Delta):  # it is decoding
            pass
        job = worker.submit(request(prompt, config), loop)
        pieces, final = [], None
        while final is None:
            event = await job.next_event()
            if isinstance(event, Delta):
                pieces.extend(lp.token for lp in event.logprobs)
            elif isinstance(event, (Finished, Failed)):
                final = event
        while not isinstance(event := await other.next_event(), (Finished, Failed)):
            pass
        return pieces, final, event

    pieces, final, other_final = asyncio.run(asyncio.wait_for(go(), 120))
    assert isinstance(final, Finished) and isinstance(other_final, Finished), (final, other_final)
    assert final.cached_tokens > 0  # it continued the kept cache
    assert pieces == alone


def test_a_kvzip_turn_answers_on_its_full_cache_and_is_kept_compressed(worker, loaded):
    config = CacheConfig(method="kvzip", budget=48, recent=8)
    opening = " ".join([OPENING] * 10)  # longer than the budget
    turns = conversation(worker, loaded, config, 3, reuse=True, opening=opening)
    full = conversation(worker, loaded, CacheConfig(method="full"), 1, reuse=False, opening=opening)
    (ids1, first), (_, second), (_, third) = turns
    assert ids1 == full[0][0]  # the first answer is the full cache's
    assert first.kv_cache["evictions"] == 0
    # Later turns continue the kept cache: compressed to the budget, then the new tokens.
    for before, after in ((first, second), (second, third)):
        assert after.cached_tokens == before.prompt_tokens + before.completion_tokens
        new = after.prompt_tokens + after.completion_tokens - after.cached_tokens
        assert after.kv_cache["tokens_kept"] <= config.budget + new + 1
    kept = worker.prompt_cache.view
    assert kept["entries"]


def test_a_kvzip_turn_over_the_memory_it_may_hold_compresses_its_prompt(loaded):
    from qfserve.engine.kv.kvzip.policy import kvzip_need, whole_need

    config = CacheConfig(method="kvzip", budget=48, recent=8)
    prompt = loaded.tokenizer.encode(" ".join([OPENING] * 10))
    bounded = kvzip_need(loaded, config, len(prompt), TURN_TOKENS)
    held = whole_need(loaded, config, len(prompt), TURN_TOKENS)
    assert held is not None and bounded < held
    with serving(worker_for(loaded, prompt_cache_size=4, max_kv_bytes=held - 1)) as w:
        _, final = ask(w, request(prompt, config))
    assert final.kv_cache["evictions"] > 0 and final.kv_cache["tokens_kept"] <= config.budget


def test_a_kvzip_prompt_longer_than_memory_allows_is_compressed_as_it_is_read(loaded, monkeypatch):
    from qfserve.engine.kv import kvzip
    from qfserve.engine.kv.kvzip.policy import compress_as_read, kvzip_need
    from qfserve.engine.kv.memory import kv_row_bytes

    config = CacheConfig(method="kvzip", budget=48, recent=8)
    prompt = loaded.tokenizer.encode(" ".join([OPENING] * 40))
    row = kv_row_bytes(loaded.model, loaded.config, config)
    # Room for twice the limit and a read (a 16-token chunk, or 17 where one would be left).
    max_kv_bytes = row * (2 * (config.budget + 40 + 17) + kvzip.REPEAT_ROWS)
    limit, need = compress_as_read(loaded, config, max_kv_bytes, 16)
    assert limit == config.budget + 40 and need <= max_kv_bytes
    assert kvzip_need(loaded, config, len(prompt), TURN_TOKENS) > max_kv_bytes
    passes = []
    init = kvzip.Reconstruction.__init__

    def counted(self, model, caches, tokens, *args, **kwargs):
        passes.append(len(tokens))
        # Never more than fits: the layers together hold at most the limit, or what they
        # may keep after a pass, and a chunk each.
        keep = caches[0].scorer.keep_limit
        assert sum(c.size() for c in caches) <= len(caches) * (max(limit, keep) + 16)
        init(self, model, caches, tokens, *args, **kwargs)

    monkeypatch.setattr(kvzip.Reconstruction, "__init__", counted)
    w = worker_for(loaded, prompt_cache_size=0, max_kv_bytes=max_kv_bytes, prefill_chunk=16)
    with serving(w):
        pieces, final = ask(w, request(prompt, config, reuse=False))
    assert len(pieces) == TURN_TOKENS and final.kv_cache["tokens_kept"] <= config.budget
    # Passes over what was read so far, each time the rows reached the limit, then the last.
    assert len(passes) >= 3 and passes == sorted(passes) and passes[-1] == len(prompt) - 1


@pytest.mark.parametrize("prefill_chunk", [16, 512, 1024, 4096])
def test_what_layers_keep_between_passes_and_a_pass_fit_what_a_limit_reserved(
    loaded, prefill_chunk
):
    """A prompt compressed as it is read: the first pass covers up to the limit and a read
    of unscored rows (a chunk, or one token more where one would be left); once a pass has
    run, the layers keep at most ``keep_limit`` rows each on average, read once more and
    run a pass over that read and the rows no pass scored (a kept turn's last generated
    ones, ``recent + 1``). Both fit the bytes admission reserved for the request."""
    from qfserve.engine.kv import kvzip
    from qfserve.engine.kv.kvzip.policy import compress_as_read
    from qfserve.engine.kv.memory import kv_row_bytes

    config = CacheConfig(method="kvzip", budget=48, recent=8)
    row = kv_row_bytes(loaded.model, loaded.config, config)
    chunk, repeat = kvzip.DEFAULT_CHUNK, kvzip.REPEAT_ROWS
    fitted = 0
    for tokens in (400, 1200, 12_000):
        fit = compress_as_read(loaded, config, row * tokens, prefill_chunk)
        if fit is None:
            continue
        fitted += 1
        limit, need = fit
        caches = make_caches(loaded.model, config)
        kvzip.set_limit(caches, limit, prefill_chunk)
        keep = caches[0].scorer.keep_limit
        read, unscored = prefill_chunk + 1, prefill_chunk + 1 + config.recent + 1
        first = limit + read + min(limit + read, chunk) + repeat
        later = keep + read + min(unscored, chunk) + repeat
        assert keep >= limit and max(first, later) * row <= need <= row * tokens
    assert fitted


def test_a_compress_as_read_limit_leaves_room_for_the_longest_adaptive_head(loaded):
    """Under adaptive budgets a compressed layer is padded to its longest head: a limit
    between the budget and that head's rows would be over as soon as a pass ended."""
    from qfserve.engine.kv.kvzip import REPEAT_ROWS
    from qfserve.engine.kv.kvzip.policy import compress_as_read
    from qfserve.engine.kv.memory import kv_row_bytes

    adaptive = CacheConfig(method="kvzip", budget=48, recent=8, budget_mode="adaptive", floor=0.5)
    per_head = replace(adaptive, budget_mode="per_head")
    heads = loaded.model.args.num_key_value_heads
    longest = heads * 48 - (heads - 1) * adaptive.floor_rows
    row = kv_row_bytes(loaded.model, loaded.config, adaptive)

    def limit_at(config: CacheConfig, rows: int):
        """The limit on a server whose memory fits ``rows`` and a 16-token read twice."""
        return compress_as_read(loaded, config, row * (2 * (rows + 17) + REPEAT_ROWS), 16)

    assert longest > 60 and limit_at(per_head, 60)[0] >= 60
    assert limit_at(adaptive, 60) is None and limit_at(adaptive, longest) is None
    assert limit_at(adaptive, longest + 1)[0] == longest + 1


@pytest.mark.parametrize("prefill_chunk", [16, 33])
def test_a_prompt_compressed_as_it_is_read_holds_no_more_than_it_reserved(
    loaded, monkeypatch, prefill_chunk
):
    """Rows shared across layers (kvzip's default), a last read one token past the chunks,
    then a turn continuing the kept one: at every forward of every pass, the layers' stored
    rows and the pass's own stay within the bytes admission reserved for the turn."""
    from qfserve.engine.kv import kvzip
    from qfserve.engine.kv.kvzip import reconstruction
    from qfserve.engine.kv.memory import kv_row_bytes
    from qfserve.engine.serving.admission import Admitter

    config = CacheConfig(method="kvzip", budget=48, recent=8, budget_mode="global")
    layer_row = kv_row_bytes(loaded.model, loaded.config, config) // len(loaded.model.layers)
    prompt = loaded.tokenizer.encode(" ".join([OPENING] * 30))
    prompt = prompt[: (len(prompt) - 1) // prefill_chunk * prefill_chunk + 2]  # k reads, then 1
    reserved, peaks, views = [], [], []
    reserve, init = Admitter._reserve, reconstruction.Reconstruction.__init__
    update = reconstruction._ReconstructionView.update_and_fetch

    def noted(self, record, need, *, alone):
        held = reserve(self, record, need, alone=alone)
        if held:  # a turn first asks for its whole cache, which does not fit here
            reserved.append(need)
            peaks.append(0)
        return held

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        views[:] = self._views

    def measured(self, keys, values):
        out = update(self, keys, values)
        peaks[-1] = max(peaks[-1], sum(view.size() for view in views) * layer_row)
        return out

    monkeypatch.setattr(Admitter, "_reserve", noted)
    monkeypatch.setattr(reconstruction.Reconstruction, "__init__", tracked)
    monkeypatch.setattr(reconstruction._ReconstructionView, "update_and_fetch", measured)
    row = kv_row_bytes(loaded.model, loaded.config, config)
    max_kv_bytes = row * (2 * (config.budget + 8 + prefill_chunk + 1) + kvzip.REPEAT_ROWS)
    w = worker_for(
        loaded, prompt_cache_size=4, max_kv_bytes=max_kv_bytes, prefill_chunk=prefill_chunk
    )
    with serving(w):
        pieces, first = ask(w, request(prompt, config))
        vocab = {loaded.tokenizer.decode([i]): i for i in range(len(loaded.tokenizer.vocab))}
        again = [*prompt, *(vocab[p] for p in pieces), *user_part(loaded, 1)]
        _, second = ask(w, request(again, config))
    assert second.cached_tokens > 0
    assert len(reserved) == 2 and all(0 < p <= r for p, r in zip(peaks, reserved, strict=True))
    assert first.kv_cache["tokens_kept"] <= config.budget


def test_a_kvzip_prompt_one_token_past_its_chunks_still_gets_its_pass(loaded, monkeypatch):
    """A prompt whose last chunk would be one token: that token would reach the caches as a
    decode step and evict the whole prompt by its provisional scores before any pass. It is
    read with the chunk before it, so the pass scores the prompt."""
    from qfserve.engine.kv import kvzip

    chunk = 16
    config = CacheConfig(method="kvzip", budget=20, recent=4, budget_mode="per_head")
    prompt = loaded.tokenizer.encode(" ".join([OPENING] * 10))
    prompt = prompt[: len(prompt) - (len(prompt) - 2) % chunk]  # read: k chunks, then 1
    assert (len(prompt) - 1) % chunk == 1 and len(prompt) > 3 * chunk
    passes = []
    init = kvzip.Reconstruction.__init__

    def counted(self, model, caches, tokens, *args, **kwargs):
        passes.append((len(tokens), max(c.size() for c in caches)))
        init(self, model, caches, tokens, *args, **kwargs)

    monkeypatch.setattr(kvzip.Reconstruction, "__init__", counted)
    w = worker_for(loaded, prompt_cache_size=0, prefill_chunk=chunk)
    with serving(w):
        _, final = ask(w, request(prompt, config, reuse=False))
    # One pass over the whole prompt, every row of it still stored when it began.
    assert passes == [(len(prompt) - 1, len(prompt) - 1)]
    assert final.kv_cache["tokens_kept"] <= config.budget


def test_an_entrys_hits_follow_its_conversation_when_a_later_turn_replaces_it():
    """mlx-lm drops a trimmable cache's prefixes when a longer turn is kept: the hits of the
    turn it replaced carry over, so per-entry hits add up to the total."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from qfserve.engine.kv.config import CacheConfig
    from qfserve.engine.reuse.kept import PromptCache, cache_key

    def caches(n: int) -> list[KVCache]:
        cache = KVCache()
        cache.update_and_fetch(mx.zeros((1, 1, n, 4)), mx.zeros((1, 1, n, 4)))
        return [cache]

    store = PromptCache(4)
    key = cache_key("m", CacheConfig(method="full"), "none")
    store.insert(key, [1, 2, 3], caches(3))
    for turn in range(1, 4):  # each turn continues the last and is kept in its place
        tokens = list(range(1, 4 + 2 * turn))
        held_caches, held = store.fetch(key, tokens)
        assert held_caches is not None and held == len(tokens) - 2
        store.insert(key, tokens, caches(len(tokens)))
    (entry,) = store.entries()
    assert entry["hits"] == store.hits == 3


def test_a_full_cache_is_saved_and_read_back(loaded, tmp_path):
    """mlx-lm's KVCache.state ends with an integer offset: it travels in the file's header."""
    import mlx.core as mx
    import numpy as np

    from qfserve.engine.reuse import disk as persist
    from qfserve.engine.reuse.kept import cache_key

    config = CacheConfig(method="full")
    caches = make_caches(loaded.model, config)
    tokens = loaded.tokenizer.encode(OPENING)
    loaded.model(mx.array([tokens]), cache=caches)
    key = cache_key(loaded.name, config, "none")
    path = persist.save(tmp_path, key, tokens, caches, "fp")
    read_key, read_tokens, back = persist.load(path, "fp", lambda c: make_caches(loaded.model, c))
    assert read_key == key and read_tokens == tokens
    for a, b in zip(caches, back, strict=True):
        assert b.offset == a.offset == len(tokens)
        np.testing.assert_array_equal(np.array(b.state[0]), np.array(a.state[0]))
        np.testing.assert_array_equal(np.array(b.state[1]), np.array(a.state[1]))


def test_keys_saved_before_the_last_settings_read_with_their_defaults():
    """A kept turn's key from before ``positions`` or ``threshold`` existed loads with them
    at their defaults (it was made without them); a key with more settings than this version
    knows is refused."""
    config = CacheConfig(method="qfilters", budget=64, recent=8, positions=True)
    now = ("model", *astuple(config), "calibrated", None)
    assert settings_of(now) == config
    before_threshold = ("model", *astuple(config)[:-1], "calibrated", None)
    assert settings_of(before_threshold) == config
    before_positions = ("model", *astuple(config)[:-2], "calibrated", None)
    assert settings_of(before_positions) == replace(config, positions=False)
    with pytest.raises(ValueError, match="settings"):
        settings_of(("model", *astuple(config), "extra", "calibrated", None))
