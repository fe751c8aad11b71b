"""The scheduler's decode batch against mlx-lm's own ``GenerationBatch`` on the same model and
caches: the same tokens and log-probabilities step by step, greedy members (the native argmax)
and a batch mixing a seeded sampler and a logits processor (mlx-lm's samplers on the native
log-probabilities)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from mlx_lm.generate import GenerationBatch, make_stop_sequences
from mlx_lm.sample_utils import make_logits_processors, make_sampler

from qfserve.engine.kv.attention import native_kernel
from qfserve.engine.kv.batch import BatchCache
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.models.quantized import detach
from qfserve.engine.serving.decoding import DecodeBatch, normalise
from qfserve.engine.text.requests import SamplingParams
from qfserve.engine.text.sampling import request_sampler
from tests.gguf_files import load_converted_tiny
from tests.kernels.conftest import _buildable

pytestmark = pytest.mark.skipif(bool(_buildable()), reason=str(_buildable()))
STEPS = 12


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    """A tiny GGUF loaded as the server loads it: the native kernel is the process's."""
    projections = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    loaded = load_converted_tiny(
        tmp_path_factory.mktemp("decoding"), projections, GGMLQuantizationType.Q8_0
    )
    assert native_kernel() is not None
    yield loaded
    detach(loaded.model)


def run(cls, loaded, prompts, samplers, processors):
    """``STEPS`` steps of a batch of ``cls`` joined member by member, as the scheduler joins
    them: (tokens, log-probabilities) per step."""
    model = loaded.model
    batch = cls.empty(model, make_sampler(0.0))
    for uid, (prompt, sampler, procs) in enumerate(zip(prompts, samplers, processors, strict=True)):
        caches = make_caches(model, CacheConfig(method="qfilters", budget=16, recent=4))
        mx.eval(model(mx.array([prompt[:-1]]), cache=caches))
        member = cls(
            model,
            [uid],
            mx.array(prompt[-1:]),
            [BatchCache([c]) for c in caches],
            [list(prompt[:-1])],
            [sampler],
            sampler,
            [procs],
            [make_stop_sequences(loaded.tokenizer)],
            [1 << 20],
        )
        batch.extend(member)
    steps = []
    for _ in range(STEPS):
        responses = batch.next()
        steps.append(
            ([r.token for r in responses], np.stack([np.array(r.logprobs) for r in responses]))
        )
    return steps


def prompts(loaded, n):
    rng = np.random.default_rng(n)
    vocab = loaded.model.args.vocab_size
    return [rng.integers(0, vocab, size=20 + 7 * i).tolist() for i in range(n)]


def assert_same(ours, theirs):
    for (tokens, logprobs), (their_tokens, their_logprobs) in zip(ours, theirs, strict=True):
        assert tokens == their_tokens
        np.testing.assert_allclose(logprobs, their_logprobs, rtol=1e-5, atol=1e-4)


def test_greedy_members_take_the_native_argmax(loaded):
    """Three greedy members: mlx-lm's tokens and log-probabilities, from the kernel's op."""
    _, best = normalise(mx.zeros((2, 40)))
    assert best is not None  # the native path is the one under test
    ps = prompts(loaded, 3)
    greedy = [make_sampler(0.0)] * 3
    ours = run(DecodeBatch, loaded, ps, greedy, [[]] * 3)
    theirs = run(GenerationBatch, loaded, ps, greedy, [[]] * 3)
    assert_same(ours, theirs)


def test_mixed_samplers_and_processors_match_mlx_lm(loaded):
    """A seeded sampler, a greedy member with a logit bias and a plain greedy one: the native
    log-probabilities feed mlx-lm's samplers and processors as its own do."""
    ps = prompts(loaded, 3)
    sp = SamplingParams(temperature=0.8, top_p=0.9, seed=7)

    def members():
        bias = make_logits_processors({5: 4.0, 9: -np.inf})
        return [request_sampler(sp), make_sampler(0.0), make_sampler(0.0)], [[], bias, []]

    ours = run(DecodeBatch, loaded, ps, *members())
    theirs = run(GenerationBatch, loaded, ps, *members())
    assert_same(ours, theirs)
    assert all(9 not in tokens[1:2] for tokens, _ in ours)  # the bias's ban held
