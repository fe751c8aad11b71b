"""One request's sampler, reproducible under its ``seed`` however it is batched.

mlx-lm's ``make_sampler`` draws from MLX's global generator, so a seeded request's tokens
would depend on what else shares the batch (every member's draw advances the same key).
A seeded request gets its own key instead, split once per token; the filters (top-p, min-p,
top-k, applied in mlx-lm's order) and the temperature are mlx-lm's own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler

from qfserve.engine.text.requests import SamplingParams

Sampler = Callable[[mx.array], mx.array]


def request_sampler(sp: SamplingParams) -> Sampler:
    """Greedy at temperature 0; mlx-lm's sampler without a seed; a keyed one with it."""
    if sp.temperature == 0:
        return _shared(0.0, 0.0, 0.0, 0)  # greedy, whatever the filters say
    if sp.seed is None:
        return _shared(sp.temperature, sp.top_p, sp.min_p, sp.top_k)
    filters: list[Sampler] = []
    if 0 < sp.top_p < 1.0:
        filters.append(lambda x: apply_top_p(x, sp.top_p))
    if sp.min_p != 0.0:
        filters.append(lambda x: apply_min_p(x, sp.min_p))
    if sp.top_k > 0:
        filters.append(lambda x: apply_top_k(x, sp.top_k))
    key = mx.random.key(sp.seed % 2**64)

    def sample(logprobs: mx.array) -> mx.array:
        nonlocal key
        key, draw = mx.random.split(key)
        for f in filters:
            logprobs = f(logprobs)
        return mx.random.categorical(logprobs * (1.0 / sp.temperature), key=draw)

    return sample


@functools.lru_cache(maxsize=64)
def _shared(temperature: float, top_p: float, min_p: float, top_k: int) -> Sampler:
    # One object per setting: mlx-lm's GenerationBatch samples the whole batch in one call
    # when its members share the sampler object, and row by row otherwise.
    return make_sampler(temperature, top_p=top_p, min_p=min_p, top_k=top_k)
