"""mlx-lm's ``GenerationBatch`` with each step's vocabulary normalised in one native op.

mlx-lm's step turns the logits into log-probabilities with ``mx.logsumexp`` before it samples,
and its greedy sampler takes ``mx.argmax`` of them. On MLX's CPU backend for x86 both are
scalar loops (its SIMD layer has NEON and Accelerate paths only): measured here, 0.78 and
0.14 ms a row for SmolLM2's 49,152 tokens, 4.1 and 0.39 ms for Gemma 3's 262,144, that is 5%
and 17% of a one-stream decode step and 6.5 ms of an 8-stream one. The native kernel's
``log_softmax`` gives both in one pass of 16-float vectors (0.09 and 0.25 ms a row).

Why a subclass: the normalisation is one line inside ``GenerationBatch._step``, with no hook
around it, so :meth:`DecodeBatch._step` is mlx-lm 0.32's own but for that line and for taking
the kernel's argmax where every member samples greedily. Elsewhere (no kernel, a GPU, other
dtypes) it is mlx-lm's arithmetic. ``tests/engine/test_decoding.py`` holds it to mlx-lm's
class: the same tokens and log-probabilities, step by step.
"""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import GenerationBatch
from mlx_lm.sample_utils import greedy_sampler

from qfserve.engine.kv.attention import native_kernel


def normalise(logits: mx.array) -> tuple[mx.array, mx.array | None]:
    """``logits - logsumexp(logits)`` over the last axis, and its argmax where the native
    kernel computed it alongside (``None``: take mlx-lm's sampler)."""
    kernel = native_kernel()
    if kernel is None or logits.dtype != mx.float32 or mx.default_device() != mx.cpu:
        return logits - mx.logsumexp(logits, axis=-1, keepdims=True), None
    logprobs, best = kernel.log_softmax(logits)
    return logprobs, best


class DecodeBatch(GenerationBatch):
    """``GenerationBatch`` whose step normalises the vocabulary through :func:`normalise`."""

    def _step(self) -> tuple[list[int], list[mx.array]]:
        b = cast(Any, self)  # mlx-lm's attributes, typed there by their first value (None)
        b._current_tokens = b._next_tokens
        b._current_logprobs = b._next_logprobs
        inputs = b._current_tokens

        logits = b.model(inputs[:, None], cache=b.prompt_cache)
        logits = logits[:, -1, :]

        token_context: list[Any] = []
        if any(b.logits_processors):
            processed_logits = []
            for e in range(len(b.uids)):
                sample_logits = logits[e : e + 1]
                processors = b.logits_processors[e] or ()
                if processors:
                    context = b._token_context[e].update_and_fetch(inputs[e : e + 1])
                    token_context.append(context)
                    for processor in processors:
                        sample_logits = processor(context, sample_logits)
                processed_logits.append(sample_logits)
            logits = mx.concatenate(processed_logits, axis=0)

        logprobs, best = normalise(logits)

        samplers = [
            b.fallback_sampler if s is None else s for s in (b.samplers or [None] * len(b.uids))
        ]
        if best is not None and all(s is greedy_sampler for s in samplers or [b.fallback_sampler]):
            sampled = best
        elif not samplers or all(s is samplers[0] for s in samplers):
            sampled = (samplers[0] if samplers else b.fallback_sampler)(logprobs)
        else:
            sampled = mx.concatenate(
                [s(logprobs[e : e + 1]) for e, s in enumerate(samplers)], axis=0
            )

        b._next_tokens = sampled
        b._next_logprobs = list(logprobs)
        mx.async_eval(b._next_tokens, b._next_logprobs, token_context)

        mx.eval(inputs, b._current_logprobs)
        tokens = inputs.tolist()
        for sti, ti in zip(b.tokens, tokens, strict=False):
            sti.append(ti)
        return tokens, b._current_logprobs
