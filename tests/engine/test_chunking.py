"""A prompt's prefill chunks cost what ``prefill_chunk`` tokens cost at its start: the model's
sizes against its weights file's own tensors, and the chunks a long prompt is cut into against
the rule recomputed from those counts."""

from __future__ import annotations

import asyncio
import re

import mlx.core as mx
import pytest

from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.models.loading import default_model_path, load_model
from qfserve.engine.serving.chunking import MIN_CHUNK, ChunkCost, chunk_limit
from qfserve.engine.text.requests import GenerationRequest, SamplingParams

FULL = 512


@pytest.fixture(scope="module")
def loaded():
    return load_model(str(default_model_path()))


def file_counts(folder) -> tuple[int, int]:
    """From the weights file itself: the elements of every layer's projection and MLP
    matrices (one multiply-add each a token), and the query heads' width (q's rows)."""
    weights = mx.load(str(folder / "model.safetensors"))
    pattern = re.compile(
        r"model\.layers\.\d+\.(self_attn\.[qkvo]|mlp\.(gate|up|down))_proj\.weight"
    )
    matrices = sum(w.size for name, w in weights.items() if pattern.fullmatch(name))
    return matrices, weights["model.layers.0.self_attn.q_proj.weight"].shape[0]


def test_the_cost_model_counts_the_files_matrices_and_query_width(loaded):
    matrices, width = file_counts(default_model_path())
    cost = ChunkCost.of(loaded)
    layers = len(loaded.model.layers)
    assert cost.per_token == matrices
    assert cost.per_row == (2.0 * width,) * layers  # a score and a value a row, every layer
    empty = make_caches(loaded.model, CacheConfig(method="full"))
    assert cost.weight(empty) == 1.0  # a prompt's first chunk reads prefill_chunk tokens


def test_chunk_limit_spends_what_a_step_has_left():
    assert chunk_limit(1.0, FULL, FULL) == FULL
    assert chunk_limit(2.0, FULL, FULL) == FULL // 2
    assert chunk_limit(100.0, FULL, FULL) == MIN_CHUNK  # a step's first chunk reads some
    assert chunk_limit(100.0, FULL - 1, FULL) == 5  # later ones only what is left
    assert chunk_limit(1.0, 16, 8) == 16  # never fewer than a small prefill_chunk's tokens


def read_alone(loaded, config: CacheConfig, prompt: list[int]) -> list[int]:
    """The tokens each scheduler step read of ``prompt``, read alone."""
    from qfserve.engine.kv.methods import MethodContext, Reservation, policy_for
    from qfserve.engine.serving.jobs import Admission, Job
    from qfserve.engine.serving.records import RequestRecord
    from qfserve.engine.serving.scheduler import Scheduler

    loop = asyncio.new_event_loop()
    scheduler = Scheduler(loaded, max_backlog=10_000, prefill_chunk=FULL)
    req = GenerationRequest(
        kind="completion",
        prompt=tuple(prompt),
        sampling=SamplingParams(max_tokens=1, temperature=0.0),
        cache=config,
    )
    job = Job(req, RequestRecord.opened("r", loaded.name, "completion", config.method), loop)
    caches = make_caches(loaded.model, config)
    policy = policy_for(config, caches, MethodContext(loaded.model, loaded.tokenizer))
    scheduler.add(Admission(job, prompt, 1, config, caches, policy, Reservation(0, "budget")))
    seq, reads = scheduler.sequences()[0], [0]
    while len(scheduler):
        scheduler.step()
        reads.append(min(seq.read, len(prompt) - 1))  # joining, it counts the last one too
    loop.close()
    return [b - a for a, b in zip(reads, reads[1:], strict=False) if b > a]


def test_a_long_prompts_chunks_shrink_as_its_cache_fills_and_evicting_caches_keep_them(loaded):
    matrices, width = file_counts(default_model_path())
    layers = len(loaded.model.layers)
    text = " ".join(f"line {i}: the fox keeps the box." for i in range(400))
    prompt = loaded.tokenizer.encode(text)[:2000]  # the model's context is 2,048

    chunks = read_alone(loaded, CacheConfig(method="full"), prompt)
    expected, read = [], 0
    while read < len(prompt) - 1:
        n = max(int(FULL / (1 + layers * 2 * width * read / matrices)), MIN_CHUNK)
        n = min(n, len(prompt) - 1 - read)
        n += len(prompt) - 1 - read - n == 1  # no one-token chunk is left
        expected.append(n)
        read += n
    assert chunks == expected
    assert chunks[0] == FULL and chunks[-2] < FULL / 2  # at ~1.5k rows: under half as many
    # Every chunk's modelled cost stays within one token's of the first chunk's.
    read = 0
    for n in chunks[:-1]:
        assert n * (matrices + layers * 2 * width * read) <= FULL * matrices
        assert (n + 1) * (matrices + layers * 2 * width * read) > FULL * matrices
        read += n

    # A cache held at its budget costs the same at every length: its chunks stay wide.
    bounded = read_alone(loaded, CacheConfig(method="knorm", budget=128, recent=16), prompt)
    assert min(bounded[:-1]) >= int(FULL / (1 + layers * 2 * width * (128 + FULL) / matrices))
    assert len(bounded) < len(chunks)
