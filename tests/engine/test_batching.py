"""Continuous batching against requests run alone through mlx-lm's own ``stream_generate``.

The reference for every request is mlx-lm's generation loop on that request's own caches
(the same ``make_caches``, prefilled in the same chunks); the batched worker must give the
same greedy tokens and log-probabilities within batched-matmul tolerance, with each request
keeping its own eviction settings.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace

import mlx.core as mx
import pytest
from mlx_lm import stream_generate
from mlx_lm.sample_utils import make_sampler

from qfserve.calibrations.model_info import model_fingerprint
from qfserve.engine.filters.artifact import resolve_calibration
from qfserve.engine.kv import kvzap
from qfserve.engine.kv.batch import PackedBatch
from qfserve.engine.kv.batch.cache import RAGGED_FACTOR, RAGGED_SLACK, BatchCache
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.kv.kvzip import RepeatPrompt, compress
from qfserve.engine.models.loading import default_model_path, load_model
from qfserve.engine.serving.chunking import ChunkCost, chunks_alone
from qfserve.engine.serving.config import DEFAULT_PREFILL_CHUNK
from qfserve.engine.text.requests import Delta, Failed, Finished, GenerationRequest, SamplingParams
from tests.workers import final_event, serving, worker_for

MAX_TOKENS = 20
SETTINGS = [  # method, budget, recent, budget_mode: every kind of cache in one batch
    CacheConfig(method="full"),
    CacheConfig(method="streaming", budget=48, recent=0, n_sink=4),
    CacheConfig(method="knorm", budget=64, recent=16),
    CacheConfig(method="qfilters", budget=96, recent=24),
    CacheConfig(method="qfilters", budget=64, recent=16, chunk=8),
    CacheConfig(method="qfilters", budget=80, recent=16, budget_mode="adaptive", floor=0.25),
    CacheConfig(method="tova", budget=56, recent=8),  # the query-aware ones read their own
    CacheConfig(method="snapkv", budget=88, recent=16),  # row of the batch's queries
    CacheConfig(method="kvzip", budget=72, recent=8),  # reconstructs its prompt first
    CacheConfig(method="kvzap", budget=64, recent=8),  # scored from its own row's hidden state
    CacheConfig(method="kvzap", budget=96, recent=8, threshold=-3.0),  # and bounded by score
    CacheConfig(method="kvzap", budget=64, recent=8, budget_mode="global"),  # shared in decode
]
PACKED = [  # only caches the batch packs into shared arrays (qfserve.engine.kv.batch.packed); the first (89
    CacheConfig(method="qfilters", budget=100, recent=8),  # tokens) fills while decoding
    CacheConfig(method="full"),
    CacheConfig(method="streaming", budget=48, recent=0, n_sink=4),
    CacheConfig(method="knorm", budget=64, recent=16),
    CacheConfig(method="qfilters", budget=96, recent=24, sign=-1),
    CacheConfig(method="qfilters", budget=72, recent=0, n_sink=2),
]


@pytest.fixture(scope="module")
def loaded():
    return load_model(str(default_model_path()))


@pytest.fixture(scope="module")
def calibration(loaded):
    filters, scale, source = resolve_calibration(
        loaded.model, loaded.model_id, fingerprint=model_fingerprint(loaded.model, loaded.config)
    )
    assert source == "calibrated"
    return filters, scale


def surrogate(loaded):
    """The served model's shipped KVzap surrogates (what the worker loads)."""
    from qfserve.calibrations.kvzap.surrogate import read_surrogate
    from qfserve.calibrations.registry import find_surrogate, model_id_for

    path = find_surrogate(model_id_for(loaded.model_id))
    assert path is not None, "the served model ships its KVzap surrogates"
    return read_surrogate(path)


def prompt_of(loaded, i: int) -> tuple[int, ...]:
    """Prompts of different lengths (120-720 tokens), so members evict at different times."""
    words = [
        "the",
        "pass",
        "key",
        "is",
        "4821",
        "remember",
        "it",
        "well",
        "and",
        "keep",
        "the",
        "fox",
        "in",
        "the",
        "box",
    ]
    text = " ".join(words[(i + k) % len(words)] for k in range(60 + 110 * i))
    return tuple(loaded.tokenizer.encode(text))


def request(loaded, i: int, config: CacheConfig, **sampling) -> GenerationRequest:
    params = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "logprobs": True, **sampling}
    return GenerationRequest(
        kind="completion",
        prompt=prompt_of(loaded, i),
        sampling=SamplingParams(**params),
        cache=config,
        # A kvzip turn kept for reuse answers on its full cache: compress this one's prompt.
        reuse=config.method != "kvzip",
    )


def alone(loaded, calibration, req: GenerationRequest) -> tuple[list[int], list[float], str]:
    """mlx-lm's ``stream_generate`` on the request's own caches: tokens, logprobs, text."""
    filters, scale = calibration
    calibrated = req.cache.method == "qfilters"
    caches = make_caches(
        loaded.model,
        req.cache,
        filters=filters if req.cache.method in ("qfilters", "kvzip") else None,
        query_scale=scale if calibrated else None,
        surrogate=surrogate(loaded) if req.cache.method == "kvzap" else None,
    )
    prompt, read = list(req.prompt), 0
    # The prompt but its last token, in the chunks the server reads it in alone (its cost
    # rule: qfserve.engine.serving.chunking, tested in test_chunking.py).
    cost = ChunkCost.of(loaded)
    # KVzap's shared rows: shared out after each chunk, before decoding and in decode, as its
    # policy has the scheduler do (qfserve.engine.kv.kvzap.KVzapPolicy).
    shares = req.cache.method == "kvzap" and req.cache.budget_mode == "global"
    for n in chunks_alone(cost, caches, len(prompt) - 1, DEFAULT_PREFILL_CHUNK):
        loaded.model(mx.array(prompt[read : read + n])[None], cache=caches)
        read += n
        if shares:
            kvzap.share(caches, decode=read == len(prompt) - 1)
    if req.cache.method == "kvzip":  # reconstruct the prompt, then generate
        repeat = RepeatPrompt.for_tokenizer(loaded.tokenizer)
        compress(loaded.model, caches, prompt[:-1], repeat)
    tokens, logprobs, text = [], [], ""
    for gen in stream_generate(
        loaded.model,
        loaded.tokenizer,
        prompt[-1:],  # type: ignore[arg-type]
        max_tokens=req.sampling.max_tokens,
        sampler=make_sampler(0.0),
        prompt_cache=caches,
    ):
        tokens.append(gen.token)
        logprobs.append(gen.logprobs[gen.token].item())
        text += gen.text
        if shares:  # between steps (the next one is built already, as in the batch)
            kvzap.share_in_decode(caches, len(tokens))
    return tokens, logprobs, text


def run_batched(loaded, requests, *, max_batch: int = 8, cancel_after: dict | None = None):
    """Every request submitted at once; returns per request (deltas, final event, worker)."""

    async def go(worker):
        loop = asyncio.get_running_loop()
        jobs = [worker.submit(r, loop) for r in requests]

        async def collect(i, job):
            deltas = []
            while True:
                event = await job.next_event()
                if isinstance(event, Delta):
                    deltas.append(event)
                    if cancel_after and cancel_after.get(i) == len(deltas):
                        job.cancel()
                elif isinstance(event, (Finished, Failed)):
                    return deltas, event

        return await asyncio.wait_for(
            asyncio.gather(*(collect(i, j) for i, j in enumerate(jobs))), 300
        )

    with serving(worker_for(loaded, max_batch=max_batch)) as worker:
        return asyncio.run(go(worker)), worker


@pytest.mark.parametrize("settings", [SETTINGS, PACKED], ids=["every-kind", "packed"])
def test_a_mixed_batch_matches_each_request_alone(loaded, calibration, settings, monkeypatch):
    packed_steps = []
    step = PackedBatch.step
    monkeypatch.setattr(
        PackedBatch,
        "step",
        lambda self, k, v: packed_steps.append(len(self.members)) or step(self, k, v),
    )
    requests = [request(loaded, i, c) for i, c in enumerate(settings)]
    results, worker = run_batched(loaded, requests)
    if settings is PACKED:  # the shared-array step ran, with the whole batch in it
        assert max(packed_steps) == len(PACKED)
    assert_each_as_alone(loaded, calibration, requests, results)
    assert worker.snapshot()["totals"]["done"] == len(settings)


def test_a_long_prompt_among_short_ones_attends_member_by_member(loaded, calibration, monkeypatch):
    """A long request joining short ones makes the batch ragged: not packed (which would pad
    every member to the longest), each member attends its own rows; every answer is still
    the one it gets alone."""
    ragged_steps = []
    attend = BatchCache._attend_members

    def counted(self, *args):
        ragged_steps.append(len(self._rows))
        return attend(self, *args)

    monkeypatch.setattr(BatchCache, "_attend_members", counted)
    text = " ".join(f"item {i} is {i * 7 % 13}" for i in range(400))
    long = GenerationRequest(
        kind="completion",
        prompt=tuple(loaded.tokenizer.encode(text)[:1800]),  # the tiny model reads 2,048
        sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=True),
        cache=CacheConfig(method="full"),
        reuse=False,
    )
    configs = [CacheConfig(method="qfilters", budget=96, recent=24), CacheConfig(method="full")]
    requests = [request(loaded, 0, c) for c in configs] + [long]
    assert len(long.prompt) > RAGGED_FACTOR * len(requests[0].prompt) + RAGGED_SLACK
    results, _ = run_batched(loaded, requests)
    assert ragged_steps and max(ragged_steps) == len(requests)
    assert_each_as_alone(loaded, calibration, requests, results)


def assert_each_as_alone(loaded, calibration, requests, results) -> None:
    """Each request's tokens, text and log-probabilities in the batch are those alone."""
    for req, (deltas, final) in zip(requests, results, strict=True):
        assert isinstance(final, Finished), final
        ref_tokens, ref_logprobs, ref_text = alone(loaded, calibration, req)
        got = [lp.logprob for d in deltas for lp in d.logprobs]
        assert [lp.token for d in deltas for lp in d.logprobs] == [
            loaded.tokenizer.decode([t]) for t in ref_tokens
        ], req.cache
        assert "".join(d.text for d in deltas) == ref_text
        assert len(got) == len(ref_logprobs) == final.completion_tokens
        assert max(abs(a - b) for a, b in zip(got, ref_logprobs, strict=True)) < 1e-4
        kv = final.kv_cache
        assert kv["method"] == req.cache.method
        if req.cache.evicts:  # each request keeps its own budget, whatever the others keep
            # (kvzap's shared rows: and up to their decode room beside it between shares)
            shared = req.cache.method == "kvzap" and req.cache.budget_mode == "global"
            room = kvzap.decode_room(req.cache.budget) if shared else 0
            assert kv["evictions"] > 0 and kv["tokens_kept"] <= req.cache.budget + room
        else:
            # Pipelined one step ahead, as mlx-lm: the last token was fed in too.
            assert kv["tokens_kept"] == final.prompt_tokens + final.completion_tokens


def test_a_cancelled_member_leaves_the_others_unchanged(loaded, calibration):
    requests = [request(loaded, i, c) for i, c in enumerate(SETTINGS[:4])]
    results, worker = run_batched(loaded, requests, cancel_after={1: 3})
    deltas, final = results[1]
    assert isinstance(final, Failed) and final.kind == "cancelled"
    assert len(deltas) < MAX_TOKENS  # it left the batch within a step or two of the cancel
    for i in (0, 2, 3):
        deltas, final = results[i]
        ref_tokens, _, _ = alone(loaded, calibration, requests[i])
        assert isinstance(final, Finished)
        assert [lp.token for d in deltas for lp in d.logprobs] == [
            loaded.tokenizer.decode([t]) for t in ref_tokens
        ]
    snap = worker.snapshot()
    assert snap["totals"]["cancelled"] == 1 and snap["totals"]["active"] == 0
    assert all(r["kept_bytes"] == 0 for r in snap["active"])


def test_a_seeded_sample_is_the_same_alone_and_in_a_batch(loaded):
    seeded = request(loaded, 2, SETTINGS[3], temperature=1.0, seed=1234, top_p=0.9)
    others = [request(loaded, i, c, temperature=1.0) for i, c in enumerate(SETTINGS[:3])]
    (solo,), _ = run_batched(loaded, [seeded], max_batch=1)
    batched, _ = run_batched(loaded, [others[0], seeded, *others[1:]])
    text = ["".join(d.text for d in deltas) for deltas, _ in (solo, batched[1])]
    assert text[0] == text[1] and text[0]
    different_seed = replace(seeded, sampling=replace(seeded.sampling, seed=99))
    (other,), _ = run_batched(loaded, [different_seed], max_batch=1)
    assert "".join(d.text for d in other[0]) != text[0]


def test_max_batch_bounds_what_runs_at_once(loaded):
    requests = [request(loaded, 0, SETTINGS[1], max_tokens=6) for _ in range(5)]
    worker = worker_for(loaded, max_batch=2)
    seen: list[int] = []
    original = worker._make_scheduler

    def spy():
        scheduler = original()
        step = scheduler.step

        def counted():
            seen.append(len(scheduler))
            return step()

        scheduler.step = counted
        return scheduler

    worker._make_scheduler = spy

    async def go():
        loop = asyncio.get_running_loop()
        jobs = [worker.submit(r, loop) for r in requests]
        return [await final_event(job) for job in jobs]

    with serving(worker):
        finals = asyncio.run(asyncio.wait_for(go(), 120))
    assert all(isinstance(f, Finished) for f in finals)
    assert max(seen) == 2  # two at once, never more, though five were waiting


def test_admission_by_kv_memory_waits_then_refuses_what_can_never_fit(loaded):
    from qfserve.engine.kv.memory import kv_need, kv_row_bytes

    config = CacheConfig(method="qfilters", budget=64, recent=16)
    reqs = [request(loaded, 1, config, max_tokens=8) for _ in range(3)]
    need = kv_need(loaded, config, len(reqs[0].prompt), 8)
    # budget + the free slot, per layer and KV head: keys and values in float32, plus the
    # cache's float32 score and int32 slot order per row
    n_layers, kv_heads = len(loaded.model.layers), loaded.config["num_key_value_heads"]
    per_row = n_layers * kv_heads * (2 * loaded.config["head_dim"] * 4 + 8)
    assert kv_row_bytes(loaded.model, loaded.config, config) == per_row
    assert need == 65 * per_row
    too_big = request(loaded, 1, CacheConfig(method="qfilters", budget=512, recent=16))
    too_long = request(loaded, 1, CacheConfig(method="full"), max_tokens=1000)
    worker = worker_for(loaded, max_batch=8, max_kv_bytes=2 * need + need // 2)
    order: list[tuple[int, str]] = []

    async def go():
        loop = asyncio.get_running_loop()
        jobs = [worker.submit(r, loop) for r in [*reqs, too_big, too_long]]

        async def collect(i, job):
            while True:
                event = await job.next_event()
                order.append((i, type(event).__name__))
                if isinstance(event, (Finished, Failed)):
                    return event

        return await asyncio.gather(*(collect(i, j) for i, j in enumerate(jobs)))

    with serving(worker):
        finals = asyncio.run(asyncio.wait_for(go(), 120))
    assert all(isinstance(f, Finished) for f in finals[:3])
    # Two fit at once; the third starts only after one of them finished.
    first_done = min(order.index((i, "Finished")) for i in (0, 1))
    assert order.index((2, "Started")) > first_done
    for final, param in zip(finals[3:], ("budget", "max_tokens"), strict=True):
        assert isinstance(final, Failed) and final.kind == "invalid_request"
        assert final.param == param and "--max-kv-bytes" in final.message
    assert worker.snapshot()["totals"]["kv_reserved_bytes"] == 0


def test_a_newcomer_prefills_one_chunk_per_step_while_the_batch_decodes(loaded):
    """A running stream gets one token per step while a long prompt is read chunk by chunk:
    the newcomer holds it up for one chunk at most, never for its whole prompt."""
    chunk = 64
    running = request(loaded, 0, SETTINGS[1], max_tokens=40)
    newcomer = request(loaded, 5, SETTINGS[3], max_tokens=4)  # ~600 tokens: ~10 chunks
    worker = worker_for(loaded, prefill_chunk=chunk)
    steps: list[tuple[int, int]] = []  # (newcomer's prompt tokens read, running's tokens)
    original = worker._make_scheduler

    def spy():
        scheduler = original()
        step = scheduler.step

        def counted():
            left = step()
            seqs = {s.job.id: s for s in scheduler.sequences()}
            if len(seqs) == 2:
                a, b = seqs[jobs[0].id], seqs[jobs[1].id]
                steps.append((b.read, a.tokens))
            return left

        scheduler.step = counted
        return scheduler

    worker._make_scheduler = spy
    jobs = []

    async def go():
        loop = asyncio.get_running_loop()
        jobs.append(worker.submit(running, loop))
        while not isinstance(await jobs[0].next_event(), Delta):  # it is decoding
            pass
        jobs.append(worker.submit(newcomer, loop))
        return [await final_event(job) for job in jobs]

    with serving(worker):
        finals = asyncio.run(asyncio.wait_for(go(), 120))
    assert all(isinstance(f, Finished) for f in finals)
    reading = [(r, t) for r, t in steps if r < len(newcomer.prompt)]
    assert len(reading) >= 5  # the prompt took several steps...
    for (r0, t0), (r1, t1) in zip(reading, reading[1:], strict=False):
        assert 0 < r1 - r0 <= chunk  # ...one chunk each...
        assert t1 == t0 + 1  # ...and the running stream decoded a token in every one


def test_a_request_waiting_for_kv_memory_is_failed_when_the_worker_stops(loaded):
    from qfserve.engine.kv.memory import kv_need

    config = CacheConfig(method="qfilters", budget=64, recent=16)
    reqs = [request(loaded, 1, config, max_tokens=200) for _ in range(2)]
    need = kv_need(loaded, config, len(reqs[0].prompt), 200)

    async def go(worker):
        loop = asyncio.get_running_loop()
        jobs = [worker.submit(r, loop) for r in reqs]
        while not isinstance(await jobs[0].next_event(), Delta):  # the first one decodes
            pass
        snap = worker.snapshot()["totals"]
        assert (snap["batch"], snap["queued"]) == (1, 1)  # the second waits for memory
        await loop.run_in_executor(None, worker.stop)
        return [await final_event(job) for job in jobs]

    with serving(worker_for(loaded, max_kv_bytes=need + need // 2)) as worker:
        finals = asyncio.run(asyncio.wait_for(go(worker), 60))  # stops the worker itself
    assert isinstance(finals[1], Failed) and finals[1].kind == "unavailable"
    assert worker.snapshot()["totals"]["active"] == 0


def test_prompts_that_end_within_the_step_join_together_and_long_ones_keep_their_chunks(loaded):
    """A step reads up to ``prefill_chunk`` prompt tokens: short prompts that end within them
    join the batch in the same step, and a long one is cut into the same chunks as alone."""
    from qfserve.engine.kv.methods import MethodContext, Reservation, policy_for
    from qfserve.engine.serving.jobs import Admission, Job
    from qfserve.engine.serving.records import RequestRecord
    from qfserve.engine.serving.scheduler import Scheduler

    chunk, states = 64, []
    scheduler = Scheduler(loaded, max_backlog=10_000, prefill_chunk=chunk)
    loop = asyncio.new_event_loop()
    lengths, config = (20, 30, 200, 40), SETTINGS[2]
    for i, n in enumerate(lengths):
        req = GenerationRequest(
            kind="completion",
            prompt=prompt_of(loaded, i)[:n],
            sampling=SamplingParams(max_tokens=3, temperature=0.0),
            cache=config,
        )
        job = Job(
            req, RequestRecord.opened(f"r{i}", loaded.name, "completion", config.method), loop
        )
        caches = make_caches(loaded.model, config)
        policy = policy_for(config, caches, MethodContext(loaded.model, loaded.tokenizer))
        plain = Reservation(0, "budget")
        scheduler.add(Admission(job, list(req.prompt), 3, config, caches, policy, plain))
    long_one = scheduler.sequences()[2]
    seen = []  # after each step: (requests decoding or done, the long prompt's tokens read)
    while len(scheduler):
        states += [left.state for left in scheduler.step()]
        seen.append((len(lengths) - len(scheduler._prefilling), long_one.read))
    loop.close()
    # Step 1: the 19 + 29 tokens of the first two; the long one waits for a whole chunk.
    assert seen[0] == (2, 0)
    # Then the long one alone, one chunk per step, as alone; its last 7 tokens leave room
    # for the fourth (39 tokens), which joins in the same step.
    assert [r for _, r in seen[1:5]] == [64, 128, 192, 200]
    assert [n for n, _ in seen[1:5]] == [2, 2, 2, 4]
    assert states == ["done"] * len(lengths)
