"""The native eviction step against the MLX one it replaces on the CPU (``evict.py``'s
``_write_and_select``): the same arrays and the same victim, ties, NaN scores, guarded slots,
per-sequence positions and held slots included."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from qfserve.engine.kv.evict import _write_and_select


def _state(rng, B, H, C, D, ties, ranked=False):
    keys = mx.array(rng.standard_normal((B, H, C, D), dtype=np.float32))
    values = mx.array(rng.standard_normal((B, H, C, D + 8), dtype=np.float32))
    raw = rng.integers(0, 4, (B, H, C)) if ties else rng.standard_normal((B, H, C))
    scores = raw.astype(np.float32)
    if not ranked:  # raw scores may be NaN; ranks are stored with NaN already mapped
        scores[..., 3] = np.nan
    order = np.stack([np.stack([rng.permutation(C) for _ in range(H)]) for _ in range(B)])
    free = mx.array(rng.integers(0, C, (B, H, 1)).astype(np.uint32))
    row = (
        mx.array(rng.standard_normal((B, H, 1, D), dtype=np.float32)),
        mx.array(rng.standard_normal((B, H, 1, D + 8), dtype=np.float32)),
        mx.array(np.where(rng.random((B, H, 1)) < 0.3, np.nan, rng.standard_normal((B, H, 1)))
                 .astype(np.float32)),
    )  # fmt: skip
    return keys, values, mx.array(scores), mx.array(order.astype(np.int32)), free, row


@pytest.mark.parametrize("ranked", [True, False])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_the_native_step_equals_mlx(kernel, ranked, ties, per_sequence):
    rng = np.random.default_rng(int(ranked) * 4 + int(ties) * 2 + int(per_sequence))
    B, H, C, D = (3, 2, 40, 16) if per_sequence else (1, 3, 64, 64)
    keys, values, scores, order, free, row = _state(rng, B, H, C, D, ties, ranked)
    if per_sequence:  # a packed batch: each member its own position, recent window and room
        position = mx.array([[[50]], [[61]], [[45]]], dtype=mx.int32)
        first_recent = position - mx.array([[[8]], [[30]], [[2]]], dtype=mx.int32)
        n_sink = mx.array([[[4]], [[0]], [[2]]], dtype=mx.int32)
        held = mx.array([[[40]], [[25]], [[33]]], dtype=mx.int32)
    else:
        position, first_recent = mx.array(70, dtype=mx.int32), mx.array(50, dtype=mx.int32)
        n_sink, held = mx.array(4, dtype=mx.int32), None
    want = _write_and_select(keys, values, scores, order, free, row, position, first_recent,
                             n_sink, held, ranked)  # fmt: skip
    got = kernel.evict_step(keys, values, scores, order, free, *row, position, first_recent,
                            n_sink, held=held, ranked=ranked)  # fmt: skip
    for name, w, g in zip(("keys", "values", "scores", "order", "free"), want, got, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        np.testing.assert_array_equal(np.array(g), np.array(w), err_msg=name)


def test_per_token_scores_and_growing_members_equal_mlx(kernel):
    """A packed batch's step with chunked members' per-token scores (the raw score, NaN
    kept, written beside the ranks) and members below their cap (their next slot is the one
    after those they hold, not a victim)."""
    rng = np.random.default_rng(11)
    B, H, C, D = 3, 2, 40, 16
    keys, values, scores, order, free, row = _state(rng, B, H, C, D, False)
    tokens = mx.array(rng.standard_normal((B, H, C)).astype(np.float32))
    position = mx.array([[[50]], [[61]], [[45]]], dtype=mx.int32)
    first_recent = position - mx.array([[[8]], [[30]], [[2]]], dtype=mx.int32)
    n_sink = mx.array([[[4]], [[0]], [[2]]], dtype=mx.int32)
    held = mx.array([[[40]], [[25]], [[33]]], dtype=mx.int32)
    caps = mx.array([[[40]], [[41]], [[2**31 - 1]]], dtype=mx.int32)  # at, below, a full cache
    args = (position, first_recent, n_sink)
    want = _write_and_select(keys, values, scores, order, free, row, *args, held, False, tokens,
                             caps)  # fmt: skip
    got = kernel.evict_step(keys, values, scores, order, free, *row, *args, held=held,
                            ranked=False, token_scores=tokens, caps=caps)  # fmt: skip
    names = ("keys", "values", "scores", "order", "free", "token_scores")
    for name, w, g in zip(names, want, got, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        np.testing.assert_array_equal(np.array(g), np.array(w), err_msg=name)
    assert np.array(got[4])[1:, :, 0].tolist() == [[25, 25], [33, 33]]  # they grow
    slot = np.array(free)[0, :, 0]
    assert np.array_equal(np.array(got[5])[0, range(H), slot], np.array(row[2])[0, :, 0],
                          equal_nan=True)  # fmt: skip


def test_every_slot_guarded_picks_the_newest(kernel):
    rng = np.random.default_rng(9)
    keys, values, scores, order, free, row = _state(rng, 1, 2, 8, 8, False)
    args = (
        mx.array(100, dtype=mx.int32),
        mx.array(-1, dtype=mx.int32),
        mx.array(0, dtype=mx.int32),
    )
    want = _write_and_select(keys, values, scores, order, free, row, *args)
    got = kernel.evict_step(keys, values, scores, order, free, *row, *args)
    np.testing.assert_array_equal(np.array(got[4]), np.array(want[4]))


def test_strided_state_is_read_and_refusals(kernel):
    """A cache's arrays that are views (transposed) are copied, not corrupted; bad shapes
    and dtypes are refused."""
    rng = np.random.default_rng(3)
    keys, values, scores, order, free, row = _state(rng, 1, 2, 16, 8, False)
    keys_t = mx.array(np.ascontiguousarray(np.array(keys).transpose(0, 1, 3, 2))).swapaxes(2, 3)
    args = (mx.array(30, dtype=mx.int32), mx.array(20, dtype=mx.int32), mx.array(2, dtype=mx.int32))
    want = _write_and_select(keys, values, scores, order, free, row, *args)
    got = kernel.evict_step(keys_t, values, scores, order, free, *row, *args)
    np.testing.assert_array_equal(np.array(got[0]), np.array(want[0]))
    with pytest.raises(ValueError, match="do not match"):
        kernel.evict_step(keys, values, scores[..., :-1], order, free, *row, *args)
    with pytest.raises(ValueError, match="int32"):
        kernel.evict_step(keys, values, scores, order, free, *row, mx.array(1.5), *args[1:])


def _strided(x: np.ndarray) -> mx.array:
    """``x`` as a view whose last axis is not contiguous (a transposed copy, swapped back)."""
    return mx.array(np.ascontiguousarray(np.swapaxes(x, -1, -2))).swapaxes(-1, -2)


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("per_sequence_direction", [False, True])
@pytest.mark.parametrize("scaled", [False, True])
def test_the_step_scores_the_new_key_by_its_projection(kernel, packed, per_sequence_direction,
                                                       scaled):  # fmt: skip
    """Given a direction (and scale) instead of a score, the new row's score is its key's
    projection (float64 numpy reference), a NaN key's NaN (then ranked lowest); the rest of
    the step is as with that score given: alone, and as a packed batch steps (raw scores,
    each member's position, recent window, sinks and held slots). Keys and direction are
    read through their strides."""
    rng = np.random.default_rng(11 + 4 * packed + 2 * per_sequence_direction + scaled)
    B, H, C, D = 3, 3, 48, 32
    keys, values, scores, order, free, (k, v, _) = _state(rng, B, H, C, D, False, not packed)
    k_np = np.array(k)
    k_np[1, 2, 0, 5] = np.nan
    shape = (B, H) if per_sequence_direction else (H,)
    direction = rng.standard_normal((*shape, D)).astype(np.float32)
    scale = rng.uniform(0.5, 2.0, (*shape, 1)).astype(np.float32) if scaled else None
    want_score = np.einsum("bhd,bhd->bh", k_np[:, :, 0].astype(np.float64),
                           np.broadcast_to(direction, (B, H, D)))[..., None]  # fmt: skip
    if scale is not None:
        want_score = want_score * np.broadcast_to(scale, (B, H, 1))
    if packed:
        position = mx.array([[[50]], [[61]], [[45]]], dtype=mx.int32)
        args = (position, position - mx.array([[[8]], [[30]], [[2]]], dtype=mx.int32),
                mx.array([[[4]], [[0]], [[2]]], dtype=mx.int32))  # fmt: skip
        held = mx.array([[[40]], [[25]], [[48]]], dtype=mx.int32)
    else:
        args = (mx.array(70, dtype=mx.int32), mx.array(60, dtype=mx.int32),
                mx.array(4, dtype=mx.int32))  # fmt: skip
        held = None
    k = _strided(k_np)
    got = kernel.evict_step(keys, values, scores, order, free, k, v, None, *args, held=held,
                            ranked=not packed, direction=_strided(direction),
                            scale=None if scale is None else mx.array(scale))  # fmt: skip
    stored = np.take_along_axis(np.array(got[2]), np.array(free).astype(np.int64), axis=2)
    if not packed:  # ranks: a NaN score is stored as -inf
        want_score = np.where(np.isnan(want_score), -np.inf, want_score)
    np.testing.assert_allclose(stored, want_score, rtol=1e-5, atol=1e-5)
    row = (k, v, mx.array(stored))
    want = _write_and_select(keys, values, scores, order, free, row, *args, held, not packed)
    for name, w, g in zip(("keys", "values", "scores", "order", "free"), want, got, strict=True):
        np.testing.assert_array_equal(np.array(g), np.array(w), err_msg=name)
    with pytest.raises(ValueError, match="give the new row.s score, the direction"):
        kernel.evict_step(keys, values, scores, order, free, k, v, row[2], *args,
                          direction=mx.array(direction))  # fmt: skip
    with pytest.raises(ValueError, match="give the new row.s score, the direction"):
        kernel.evict_step(keys, values, scores, order, free, k, v, None, *args)
    with pytest.raises(ValueError, match="direction must be"):
        kernel.evict_step(keys, values, scores, order, free, k, v, None, *args,
                          direction=mx.array(direction[..., :-1]))  # fmt: skip


def test_a_projection_the_op_cannot_take_falls_back(kernel):
    """write_and_select with the kernels set: a float32 projection goes to the op, one whose
    direction is float16 or of another batch to the MLX step, which scores it as the scorer
    would, instead of the op refusing it mid-decode."""
    from qfserve.engine.kv import attention
    from qfserve.engine.kv.evict import write_and_select
    from qfserve.engine.kv.scorers import ScoreForm

    rng = np.random.default_rng(21)
    B, H, C, D = 2, 2, 24, 16
    keys, values, scores, order, free, (k, v, _) = _state(rng, B, H, C, D, False, True)
    args = (mx.array(40, dtype=mx.int32), mx.array(30, dtype=mx.int32), mx.array(2, dtype=mx.int32))
    calls = []

    class Counting:
        def evict_step(self, *a, **kw):
            calls.append(kw.get("direction") is not None)
            return kernel.evict_step(*a, **kw)

    direction = rng.standard_normal((1, H, D)).astype(np.float32)
    attention.set_native(Counting())
    try:
        for form, native in [
            (ScoreForm("project", mx.array(direction[0])), True),
            (ScoreForm("project", mx.array(direction[0], dtype=mx.float16)), False),
            (ScoreForm("project", mx.array(direction)), False),  # batch 1 against 2
        ]:
            calls.clear()
            got = write_and_select(keys, values, scores, order, free, (k, v, form), *args)
            assert calls == ([True] if native else [])
            want = _write_and_select(keys, values, scores, order, free,
                                     (k, v, form.projected(k)), *args)  # fmt: skip
            for name, w, g in zip(("keys", "values", "scores", "order"), want, got, strict=False):
                np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-5, err_msg=name)
            np.testing.assert_array_equal(np.array(got[4]), np.array(want[4]))
    finally:
        attention.set_native(None)


@pytest.mark.parametrize("tokens", [False, True])
def test_the_step_scores_the_new_row_by_its_hidden_state(kernel, tokens):
    """Given the hidden row before its norm and a linear map (KVzap's surrogate) instead of a
    score, the new row's score is ``bias + rms_norm(x) . weight`` (float64 numpy reference),
    the raw score in the per-token scores too where the cache keeps them; the rest of the step
    is as with that score given. The same form through ``write_and_select`` without the
    kernels (MLX: ``ScoreForm.mapped``) gives the same step."""
    from qfserve.engine.kv import attention
    from qfserve.engine.kv.evict import write_and_select
    from qfserve.engine.kv.scorers import ScoreForm

    rng = np.random.default_rng(31 + tokens)
    H, C, D, K, eps = 3, 40, 16, 96, 1e-5
    keys, values, scores, order, free, (k, v, _) = _state(rng, 1, H, C, D, False, True)
    x = rng.standard_normal((1, 1, K)).astype(np.float32) * 3
    norm = rng.uniform(0.5, 1.5, K).astype(np.float32)
    weight = rng.standard_normal((H, K)).astype(np.float32)
    bias = rng.standard_normal((H, 1)).astype(np.float32)
    x64 = x[0, 0].astype(np.float64)
    normed = x64 / np.sqrt(np.mean(x64**2) + eps) * norm
    want_score = (weight @ normed + bias[:, 0])[None, :, None]
    token_scores = mx.array(rng.standard_normal((1, H, C)).astype(np.float32)) if tokens else None
    args = (mx.array(70, dtype=mx.int32), mx.array(60, dtype=mx.int32), mx.array(4, dtype=mx.int32))
    hidden = [mx.array(x), mx.array(norm), _strided(weight), mx.array(bias)]
    got = kernel.evict_step(
        keys,
        values,
        scores,
        order,
        free,
        k,
        v,
        None,
        *args,
        token_scores=token_scores,
        hidden=hidden,
        eps=eps,
    )
    slot = np.array(free).astype(np.int64)
    stored = np.take_along_axis(np.array(got[2]), slot, axis=2)
    np.testing.assert_allclose(stored, want_score, rtol=1e-5, atol=1e-5)
    if tokens:
        np.testing.assert_array_equal(np.take_along_axis(np.array(got[5]), slot, axis=2), stored)
    want = _write_and_select(
        keys,
        values,
        scores,
        order,
        free,
        (k, v, mx.array(stored)),
        *args,
        token_scores=token_scores,
    )
    for name, w, g in zip(("keys", "values", "scores", "order", "free"), want, got, strict=False):
        np.testing.assert_array_equal(np.array(g), np.array(w), err_msg=name)

    form = ScoreForm("hidden", mx.array(weight), mx.array(bias), (mx.array(x), mx.array(norm), eps))
    np.testing.assert_allclose(np.array(form.mapped()), want_score, rtol=1e-5, atol=1e-5)
    attention.set_native(None)
    mlx_step = write_and_select(
        keys, values, scores, order, free, (k, v, form), *args, token_scores=token_scores
    )
    np.testing.assert_allclose(np.array(mlx_step[2]), np.array(got[2]), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(np.array(mlx_step[4]), np.array(got[4]))

    state = (keys, values, scores, order, free, k, v, None, *args)
    with pytest.raises(ValueError, match="hidden: x"):
        kernel.evict_step(*state, hidden=[*hidden[:2], hidden[2][:, :-1], hidden[3]])
    with pytest.raises(ValueError, match="give the new row.s score, the direction"):
        kernel.evict_step(*state, direction=mx.array(weight[:, :D]), hidden=hidden)
