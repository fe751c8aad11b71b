"""KVzip+ scores of one text: what KVzap's surrogates learn to predict.

The model reads ``context``, the reconstruction prompt (:class:`~qfserve.calibrations.repeat.
RepeatPrompt`: the repeat instruction, then the chat template's assistant opening) and
``context`` again, in one causal forward on plain caches. For layer ``l``, query head ``h`` of
KV head ``g``, a key ``i`` of the first context, and each query ``t`` of the repeated context:

    score[g, i] = max over h in g, t of  a[h, t, i] * ||W_O^h v_i|| / ||x_t||

where ``a`` is the model's own attention probability (softmax over every causal key), ``v_i``
the value of ``i`` in ``g``, ``W_O^h`` the columns of the output projection that read head
``h``, and ``x_t`` the hidden state that enters the layer's attention at ``t`` (after the
input norm). The target is ``log(score)``. This is the target kvpress's KVzap trains on (its data script)
on the reconstruction prompt our own KVzip pass uses: the attention a key receives while the
model says the context again, weighted by what its value adds to the residual stream. The
surrogate's input is ``x_i``, the hidden state the key itself is written from.

Sliding-window layers never evict, so they get no targets (``None``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache, make_prompt_cache

from qfserve.calibrations.capture import QueryRoPE
from qfserve.calibrations.kvzap.hidden import install_hidden_taps, layers_of, remove_hidden_taps
from qfserve.calibrations.model_info import attention_modules, head_counts
from qfserve.calibrations.repeat import RepeatPrompt

TINY = 1e-30  # floor under a score before its log (a key no query reads at all)


@dataclass
class TextTargets:
    """One text's surrogate inputs and targets, per layer (``None``: a layer that does not
    evict).

    Args:
        hidden: ``(C, hidden)`` float32: the input-norm output of each context token.
        targets: ``(C, n_kv_heads)`` float32 log KVzip+ scores.
    """

    hidden: list[np.ndarray | None]
    targets: list[np.ndarray | None]


def dense_weight(linear: Any) -> mx.array:
    """A linear layer's weight ``(out, in)`` in float32, dequantized where it holds codes."""
    if "scales" in linear:
        return mx.dequantize(
            linear["weight"],
            linear["scales"],
            linear.get("biases"),
            group_size=linear.group_size,
            bits=linear.bits,
        ).astype(mx.float32)
    return linear["weight"].astype(mx.float32)


def full_layers(model: nn.Module) -> list[bool]:
    """Which layers attend to every position (plain ``KVCache``): the ones that evict."""
    return [type(c) is KVCache for c in make_prompt_cache(model)]


def layer_scores(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    out_weight: mx.array,
    hidden_norms: mx.array,
    scale: float,
    context: tuple[int, int],
    repeated: tuple[int, int],
) -> mx.array:
    """KVzip+ scores ``(n_kv_heads, C)`` of one layer (before the log).

    Args:
        queries: ``(H_q, T, D)`` rotated queries of the whole sequence.
        keys: ``(H_kv, T, D)`` rotated keys; values ``(H_kv, T, Dv)``.
        out_weight: ``(hidden, H_q * Dv)`` the output projection.
        hidden_norms: ``(T,)`` norms of the attention's input per position.
        scale: The layer's attention scale.
        context: ``[start, end)`` of the context's keys.
        repeated: ``[start, end)`` of the repeated context's queries.
    """
    n_heads, _, _ = queries.shape
    n_kv, T, dv = values.shape
    group = n_heads // n_kv
    sp, ep = context
    sr, er = repeated
    q = queries[:, sr:er].astype(mx.float32)  # (H_q, R, D)
    k = mx.repeat(keys.astype(mx.float32), group, axis=0)  # (H_q, T, D)
    logits = (q @ k.transpose(0, 2, 1)) * scale  # (H_q, R, T)
    causal = mx.arange(T)[None, :] <= mx.arange(sr, er)[:, None]  # (R, T)
    logits = mx.where(causal[None], logits, -mx.inf)
    probs = mx.softmax(logits, axis=-1)[:, :, sp:ep]  # (H_q, R, C)
    probs = probs / hidden_norms[sr:er][None, :, None]
    read = probs.max(axis=1)  # (H_q, C)
    # ||W_O^h v_i||: the Gram matrix of each head's columns, applied to its group's values.
    w = out_weight.reshape(out_weight.shape[0], n_heads, dv).transpose(1, 0, 2)  # (H_q, hid, Dv)
    gram = w.transpose(0, 2, 1) @ w  # (H_q, Dv, Dv)
    v = mx.repeat(values[:, sp:ep].astype(mx.float32), group, axis=0)  # (H_q, C, Dv)
    weight = mx.sqrt(mx.maximum(((v @ gram) * v).sum(axis=-1), 0.0))  # (H_q, C)
    scores = (read * weight).reshape(n_kv, group, ep - sp).max(axis=1)
    return scores


def text_targets(model: nn.Module, context: Sequence[int], repeat: RepeatPrompt) -> TextTargets:
    """The surrogate inputs and KVzip+ targets of one text (see the module doc)."""
    lead = [*repeat.first, *repeat.suffix]
    ids = [*context, *lead, *context]
    C = len(context)
    span, again = (0, C), (C + len(lead), C + len(lead) + C)
    modules = attention_modules(model)
    queries: list[mx.array | None] = [None] * len(modules)
    ropes = []
    for i, attn in enumerate(modules):
        n_heads, n_kv, _ = head_counts(attn, model)

        def keep(rotated: mx.array, offset: Any, i: int = i) -> None:
            queries[i] = rotated

        ropes.append(attn.rope)
        attn.rope = QueryRoPE(attn.rope, keep, n_heads, n_kv)
    had_taps = any(
        hasattr(layer.input_layernorm, "_qfserve_hidden_tap") for layer in layers_of(model)
    )
    taps = install_hidden_taps(model)
    caches = make_prompt_cache(model)
    try:
        model(mx.array(ids)[None], cache=caches)
        hidden = [tap.batch for tap in taps]
        mx.eval(queries, hidden, [c.state for c in caches])
    finally:
        for attn, rope in zip(modules, ropes, strict=True):
            attn.rope = rope
        if not had_taps:
            remove_hidden_taps(model)
    full = full_layers(model)
    inputs: list[np.ndarray | None] = []
    targets: list[np.ndarray | None] = []
    for i, attn in enumerate(modules):
        h, q = hidden[i], queries[i]
        if not full[i] or h is None or q is None:
            inputs.append(None)
            targets.append(None)
            continue
        cache = caches[i]
        keys, values = cache.keys[0, :, : len(ids)], cache.values[0, :, : len(ids)]
        norms = mx.linalg.norm(h[0].astype(mx.float32), axis=-1)
        scores = layer_scores(
            q[0], keys, values, dense_weight(attn.o_proj), norms, float(attn.scale), span, again
        )
        targets.append(np.log(np.maximum(np.array(scores.T), TINY)).astype(np.float32))
        inputs.append(np.array(h[0, :C].astype(mx.float32)))
    return TextTargets(inputs, targets)
