"""KVzip caches against an independent reconstruction: the tiny model run on a plain cache.

The reference feeds each reconstruction chunk (context, then the chunk's ids) to mlx-lm's own
``KVCache`` in one call, captures every layer's rotated queries with a rope wrapper written
here, and computes the scores with numpy: an explicit softmax over the sinks, the chunk's
context keys and the reconstruction keys (causal), the max over the chunk's queries and the
query heads of each KV group. Selection is checked against a numpy top-k with the sinks and
the recent window protected, and the kept keys against the full cache's at their positions.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from collections import Counter

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache

from qfserve import testing
from qfserve.engine.kv import attention
from qfserve.engine.kv.config import CacheConfig, ConfigError
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.kv.kvzip import (
    DEFAULT_CHUNK,
    PREV_TAIL,
    Reconstruction,
    RepeatPrompt,
    compress,
    generated_tier,
    needs_pass,
    over_limit,
    reconstruction,
    set_limit,
)

CHUNK = 16  # context tokens per reconstruction chunk: the test context spans three


class _Capture(nn.Module):
    """A layer's rope, unchanged, keeping the last rotated query block."""

    def __init__(self, rope: nn.Module, n_heads: int) -> None:
        super().__init__()
        self.rope, self.n_heads, self.queries = rope, n_heads, None

    def __call__(self, x: mx.array, offset: int = 0) -> mx.array:
        y = self.rope(x, offset=offset)
        if x.shape[1] == self.n_heads:
            self.queries = y
        return y


@pytest.fixture(scope="module")
def tiny():
    from qfserve.engine.models.loading import default_model_path, load_model

    loaded = load_model(str(default_model_path()))
    tokens = loaded.tokenizer.encode(" ".join(f"w{i % 11} is {i}" for i in range(9)))
    return loaded, tokens[:40]


def reference_scores(model, context: list[int], repeat: RepeatPrompt, n_sink: int) -> np.ndarray:
    """(layers, H, L) scores of the context rows, computed without engine code."""
    layers = model.layers
    attn0 = layers[0].self_attn
    Hq, H = attn0.n_heads, attn0.n_kv_heads
    L = len(context)
    base = [KVCache() for _ in layers]
    model(mx.array(context)[None], cache=base)
    out = np.zeros((len(layers), H, L), dtype=np.float64)
    for start in range(0, L, CHUNK):
        end = min(L, start + CHUNK)
        lead = repeat.first if start == 0 else (*repeat.next, *context[start - PREV_TAIL : start])
        ids = [*lead, *repeat.suffix, *context[start:end]]
        caches = copy.deepcopy(base)
        ropes = []
        for layer in layers:
            ropes.append(layer.self_attn.rope)
            layer.self_attn.rope = _Capture(layer.self_attn.rope, Hq)
        try:
            model(mx.array(ids)[None], cache=caches)
            captured = [np.array(layer.self_attn.rope.queries[0]) for layer in layers]
        finally:
            for layer, rope in zip(layers, ropes, strict=True):
                layer.self_attn.rope = rope
        R = len(ids)
        sinks = min(n_sink, start)
        for i, (q, cache) in enumerate(zip(captured, caches, strict=True)):
            k = np.array(cache.keys[0, :, : L + R], dtype=np.float64)  # (H, L + R, D)
            cols = [*range(sinks), *range(start, end), *range(L, L + R)]
            logits = np.einsum(
                "hrd,hsd->hrs", q.astype(np.float64), k[np.arange(Hq) // (Hq // H)][:, cols]
            )
            logits *= layers[i].self_attn.scale
            own = len(cols) - R
            future = np.triu(np.ones((R, R), dtype=bool), 1)
            logits[:, :, own:][:, future] = -np.inf
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            chunk = p[:, :, sinks:own].reshape(H, Hq // H, R, end - start).max(axis=(1, 2))
            out[i, :, start:end] = chunk
    return out


def numpy_keep(scores: np.ndarray, budget: int, n_sink: int, recent: int) -> np.ndarray:
    """(H, budget) kept positions: protected rows first, then the highest scores, the lower
    position among ties."""
    H, L = scores.shape
    ranked = scores.copy()
    ranked[:, :n_sink] = np.inf
    ranked[:, L - recent :] = np.inf
    kept = []
    for h in range(H):
        order = sorted(range(L), key=lambda j: (-ranked[h, j], j))[:budget]
        kept.append(sorted(order))
    return np.array(kept)


class _Counting:
    """A kernel module whose calls are counted by name."""

    def __init__(self, kernel) -> None:
        self.kernel, self.calls = kernel, Counter()

    def __getattr__(self, name):
        fn = getattr(self.kernel, name)

        def counted(*args, **kwargs):
            self.calls[name] += 1
            return fn(*args, **kwargs)

        return counted


@pytest.fixture(params=["mlx", "native"])
def kernels(request):
    """Attention through MLX and numpy's tiles (``None``), or through the native kernels
    (prefill, and the pass's scores in one op), where they build here."""
    counting = None
    if request.param == "native":
        from qfserve.engine.models.gguf.convert import cache_root
        from qfserve.kernels import native

        kernel = native.load(cache_root() / "native")
        if kernel is None:
            pytest.skip("the native kernels do not build here")
        counting = _Counting(kernel)
        attention.set_native(counting)
    yield counting
    attention.set_native(None)


@pytest.fixture
def cut_chunks(monkeypatch):
    """A step feeds a chunk's rest whole within ``REPEAT_ROWS`` of its limit, which would
    feed the tiny model's chunks whole: without that slack, blocks cut chunks, so the
    reconstruction rows build up over forwards and the scores are maxed across them."""
    monkeypatch.setattr(reconstruction, "REPEAT_ROWS", 0)


def test_scores_equal_an_independent_reconstruction(tiny, kernels, cut_chunks):
    loaded, tokens = tiny
    model, context = loaded.model, tokens[:-1]
    repeat = RepeatPrompt.for_tokenizer(loaded.tokenizer)
    caches = make_caches(model, CacheConfig(method="kvzip", budget=1000, n_sink=4))
    model(mx.array(context)[None], cache=caches)
    compress(model, caches, context, repeat, chunk=CHUNK, block=7)  # blocks cut chunks
    if kernels is not None:  # more forwards than chunks: chunks were cut
        assert kernels.calls["reconstruction_attention"] > len(model.layers) * len(
            repeat.chunks(context, CHUNK)
        )
    ours = np.stack([np.array(c.token_scores[0]) for c in caches])
    attention.set_native(None)  # the reference runs on MLX's own attention
    ref = reference_scores(model, context, repeat, n_sink=4)
    np.testing.assert_allclose(ours, ref, rtol=2e-4, atol=2e-6)
    assert all(c.size() == len(context) for c in caches)  # under budget: nothing dropped
    if kernels is not None:  # every layer's every pass block, and the prompt, went native
        assert kernels.calls["reconstruction_attention"] > 0
        assert kernels.calls["prefill_attention"] == len(model.layers)


@pytest.mark.parametrize("recent", [0, 5])
def test_kept_rows_are_the_budget_with_true_positions(tiny, recent):
    loaded, tokens = tiny
    model, context = loaded.model, tokens[:-1]
    repeat = RepeatPrompt.for_tokenizer(loaded.tokenizer)
    budget = 17
    caches = make_caches(model, CacheConfig(method="kvzip", budget=budget, recent=recent))
    full = [KVCache() for _ in model.layers]
    model(mx.array(context)[None], cache=full)
    model(mx.array(context)[None], cache=caches)
    assert needs_pass(caches)
    compress(model, caches, context, repeat, chunk=CHUNK)
    ref = reference_scores(model, context, repeat, n_sink=4)
    for i, (cache, plain) in enumerate(zip(caches, full, strict=True)):
        kept = numpy_keep(ref[i], budget, 4, recent)
        assert cache.size() == budget
        np.testing.assert_array_equal(np.array(cache.positions[0]), kept)
        # Each kept row is the full cache's row at its position: rotation and value intact.
        full_keys = np.array(plain.keys[0])
        for h in range(kept.shape[0]):
            np.testing.assert_array_equal(np.array(cache.keys[0, h]), full_keys[h, kept[h]])
        assert cache.offset == len(context)


def test_decode_stays_bounded_and_generated_rows_go_first(tiny):
    loaded, tokens = tiny
    model, context = loaded.model, tokens[:-1]
    repeat = RepeatPrompt.for_tokenizer(loaded.tokenizer)
    budget, recent = 17, 4
    caches = make_caches(model, CacheConfig(method="kvzip", budget=budget, recent=recent))
    model(mx.array(context)[None], cache=caches)
    compress(model, caches, context, repeat, chunk=CHUNK)
    chosen = [[set(np.array(c.positions[0, h]).tolist()) for h in range(2)] for c in caches]
    y = mx.array(tokens[-1:])[None]
    for _ in range(12):
        y = mx.argmax(model(y, cache=caches)[:, -1], axis=-1)[None]
    mx.eval(y)
    for c, before in zip(caches, chosen, strict=True):
        assert c.size() == budget and c.offset == len(context) + 12
        free = np.array(c.free[0, :, 0])
        for h in range(2):
            order = np.array(c.order[0, h])  # the slots' true positions (one slot is free)
            rows = set(np.delete(order, free[h]).tolist())
            generated = {p for p in rows if p >= len(context)}
            # Generated rows beyond the recent window went before any row KVzip chose.
            assert generated == set(range(c.offset - recent, c.offset))
            assert rows - generated <= before[h]


def test_budget_above_the_prompt_generates_as_the_full_cache(tiny):
    loaded, tokens = tiny
    model = loaded.model

    def greedy(config: CacheConfig) -> list[int]:
        caches = make_caches(model, config)
        model(mx.array(tokens[:-1])[None], cache=caches)
        assert not needs_pass(caches)
        y, out = mx.array(tokens[-1:])[None], []
        for _ in range(16):
            y = mx.argmax(model(y, cache=caches)[:, -1], axis=-1)[None]
            out.append(int(y.item()))
        return out

    assert greedy(CacheConfig(method="kvzip", budget=256)) == greedy(CacheConfig(method="full"))


def test_adaptive_budgets_share_the_layer_rows(tiny):
    loaded, tokens = tiny
    model, context = loaded.model, tokens[:-1]
    repeat = RepeatPrompt.for_tokenizer(loaded.tokenizer)
    config = CacheConfig(method="kvzip", budget=17, budget_mode="adaptive", floor=0.3)
    caches = make_caches(model, config)
    model(mx.array(context)[None], cache=caches)
    compress(model, caches, context, repeat, chunk=CHUNK)
    ref = reference_scores(model, context, repeat, n_sink=4)
    for i, cache in enumerate(caches):
        counts = np.array(cache.valid[0].sum(axis=-1))
        assert counts.sum() == 17 * 2 and counts.min() >= config.floor_rows
        # The kept rows are the layer's best over both heads, beyond each head's floor.
        valid = np.array(cache.valid[0])
        kept = [set(np.array(cache.positions[0, h])[valid[h]].tolist()) for h in range(2)]
        dropped = [set(range(len(context))) - kept[h] for h in range(2)]
        for h in range(2):
            if len(kept[h]) > config.floor_rows:
                worst_kept = min(ref[i, h, p] for p in kept[h] if p >= 4)
                best_dropped = max(
                    (ref[i, g, p] for g in range(2) for p in dropped[g]), default=-1.0
                )
                assert worst_kept >= best_dropped


def shared_reference(ref: np.ndarray, budget: int, recent: int, limit: int | None = None):
    """Each layer's share and kept ``(head, position)`` set when every layer shares
    ``budget * H * layers`` rows by the reference scores, protected rows first, and the
    head cap: with a ``limit``, where the layers' longest heads hold more than ``limit``
    rows a layer, every head keeps at most the largest cap that fits (its other rows go)."""
    layers, H, L = ref.shape
    guarded = ref.copy()
    guarded[:, :, :4] = np.inf
    guarded[:, :, L - recent :] = np.inf
    kth = np.sort(guarded.reshape(-1))[::-1][budget * H * layers - 1]
    per_head = ((guarded >= kth) & (guarded > -np.inf)).sum(-1)  # (layers, H)
    cap = None
    if limit is not None and per_head.max(-1).sum() > limit * layers:
        cap = max(c for c in range(L + 1) if np.minimum(per_head.max(-1), c).sum() <= limit * layers)  # fmt: skip
        per_head = np.minimum(per_head, cap)
    shares = [max(int(per_head[i].sum()) // H, 4 + recent) for i in range(layers)]
    kept = []
    for i in range(layers):
        best = [sorted(range(L), key=lambda p, h=h: (-guarded[i, h, p], p))[:cap] for h in range(H)]  # fmt: skip
        order = sorted(((h, p) for h in range(H) for p in best[h]),
                       key=lambda hp: (-guarded[i, hp[0], hp[1]], hp[0], hp[1]))  # fmt: skip
        kept.append(set(order[: shares[i] * H]))
    return shares, kept, cap


def _kept(cache) -> set:
    valid = np.array(cache.valid[0])
    H = valid.shape[0]
    return {(h, p) for h in range(H) for p in np.array(cache.positions[0, h])[valid[h]]}


def test_global_budgets_share_every_layer_rows(tiny):
    loaded, tokens = tiny
    model, context = loaded.model, tokens[:-1]
    repeat = RepeatPrompt.for_tokenizer(loaded.tokenizer)
    budget, recent = 13, 2
    config = CacheConfig(method="kvzip", budget=budget, recent=recent, budget_mode="global")
    caches = make_caches(model, config)
    model(mx.array(context)[None], cache=caches)
    compress(model, caches, context, repeat, chunk=CHUNK)
    ref = reference_scores(model, context, repeat, n_sink=4)  # (layers, H, L)
    layers = ref.shape[0]
    shares, kept, _ = shared_reference(ref, budget, recent)
    # Each layer keeps whole rows per head: at most one row per head short of its share.
    assert budget * layers - layers <= sum(shares) <= budget * layers
    for i, cache in enumerate(caches):
        assert cache.budget == shares[i]
        # The layer's share goes to its best rows over every head, protected rows first.
        assert _kept(cache) == kept[i]
    assert len({c.budget for c in caches}) > 1 or layers == 1


def _read_and_compress(tiny, limit: int | None) -> tuple[list, np.ndarray]:
    """The tiny model's context in kvzip caches of 13 rows shared across layers (recent 2),
    under a compress-as-read ``limit``, after one pass: (caches, reference scores). The
    prompt is read in chunks of a whole reconstruction chunk, so the layers may keep
    ``limit`` rows after a pass (``keep_limit``)."""
    loaded, tokens = tiny
    model, context = loaded.model, tokens[:-1]
    repeat = RepeatPrompt.for_tokenizer(loaded.tokenizer)
    config = CacheConfig(method="kvzip", budget=13, recent=2, budget_mode="global")
    caches = make_caches(model, config)
    if limit is not None:
        set_limit(caches, limit, prefill_chunk=DEFAULT_CHUNK)
        assert caches[0].scorer.keep_limit == limit
    model(mx.array(context)[None], cache=caches)
    compress(model, caches, context, repeat, chunk=CHUNK)
    return caches, reference_scores(model, context, repeat, n_sink=4)


def test_a_compress_as_read_limit_bounds_the_layers_padded_rows(tiny):
    """A layer is stored padded to its longest head, and a prompt compressed as it is read
    reserved ``limit`` rows a layer: where the layers' longest heads would sum to more, they
    are cut to the largest cap that fits. Below that, copying heads keep what they win (one
    SmolLM2 head kept 5,753 of 8,085 rows at 8k, and capping it cost the needle)."""
    free, _ = _read_and_compress(tiny, None)
    layers = len(free)
    assert all(c.scorer.cap is None for c in free)
    longest = sum(c.size() for c in free)
    limit = (longest - 6) // layers
    assert max(c.size() for c in free) > limit + 6  # one layer's longest head outgrows it
    caches, ref = _read_and_compress(tiny, limit)
    shares, kept, cap = shared_reference(ref, 13, 2, limit=limit)
    assert cap is not None and limit < cap < max(c.size() for c in free)
    assert sum(c.size() for c in caches) <= limit * layers
    for i, cache in enumerate(caches):
        assert cache.scorer.cap == cap and cache.size() <= cap
        assert cache.budget == shares[i] and _kept(cache) == kept[i]
    # The memory is the request's: a layer over the limit is balanced by the others.
    set_limit(free, -(-longest // layers), prefill_chunk=DEFAULT_CHUNK)
    assert max(c.size() for c in free) > free[0].scorer.limit and not over_limit(free)
    set_limit(free, longest // layers - 1, prefill_chunk=DEFAULT_CHUNK)
    assert over_limit(free)
    # A limit the rows fit within changes nothing.
    roomy, _ = _read_and_compress(tiny, longest // layers + 1)
    assert all(c.scorer.cap is None for c in roomy)
    assert [_kept(c) for c in roomy] == [_kept(c) for c in free]


def _shared_after_a_pass(tiny, recent: int) -> tuple:
    """The tiny model's context read into kvzip caches of 13 rows shared across layers,
    then compressed by a pass: (model, tokens, repeat prompt, caches)."""
    loaded, tokens = tiny
    model, context = loaded.model, tokens[:-1]
    repeat = RepeatPrompt.for_tokenizer(loaded.tokenizer)
    config = CacheConfig(method="kvzip", budget=13, recent=recent, budget_mode="global")
    caches = make_caches(model, config)
    model(mx.array(context)[None], cache=caches)
    assert needs_pass(caches)
    compress(model, caches, context, repeat, chunk=CHUNK)
    return model, tokens, repeat, caches


def test_a_pass_leaves_nothing_for_another_to_cut(tiny):
    """Once a pass has scored every row, no further pass is due, even where a layer keeps
    more than the budget (rows shared across layers). Forced anyway, a pass with nothing to
    score keeps what the first kept: the layers' shares count real rows only. (The server
    read the prompt, ran the pass, then an empty one; that one counted the padding of ragged
    heads as rows whenever the kept rows were fewer than the request's, and cutting the
    excess took up to two thirds of the largest layers' rows before the answer.)"""
    model, tokens, repeat, caches = _shared_after_a_pass(tiny, recent=2)
    context = tokens[:-1]
    assert any(c.size() > 13 for c in caches)  # some layer's share is above the budget
    assert any(c.size() > int(np.array(c.valid).sum(-1).min()) for c in caches)  # ragged
    assert sum(int(np.array(c.valid).sum()) for c in caches) < 13 * 2 * len(caches)
    assert not needs_pass(caches)
    kept = [(c.budget, _kept(c)) for c in caches]
    run = Reconstruction(model, caches, context, repeat, chunk=CHUNK)
    assert run.done
    run.step(1)  # the scheduler's step, with nothing to score
    assert [(c.budget, _kept(c)) for c in caches] == kept
    # A generated row (a provisional score) over the budget makes a pass due again.
    model(mx.array(tokens[-1:])[None], cache=caches)
    assert needs_pass(caches) == any(c.size() > 13 for c in caches)


def test_an_evicted_row_in_the_free_slot_is_not_unscored(tiny):
    """A decode row evicted at once (no recent window) leaves its provisional score in the
    slot it freed: that row is gone, so no pass is due for it (one would cut the kept rows)."""
    model, tokens, _, caches = _shared_after_a_pass(tiny, recent=0)
    model(mx.array(tokens[-1:])[None], cache=caches)  # the lowest row: evicted at once
    freed = [c for c in caches if c.free is not None]
    assert freed and any(
        bool((c.token_scores < 0).any().item()) for c in freed
    )  # the victim's score is still stored
    assert not needs_pass(caches)


def test_generated_tier_keeps_order_below_zero():
    s = mx.array([-1e4, -50.0, -1.0, 0.0, 1.0, 50.0, 51.0, 1e4])
    t = np.array(generated_tier(s))
    assert (t < 0).all() and (t > -1).all() and (np.diff(t) > 0).all()


def test_kvzip_refuses_chunks():
    with pytest.raises(ConfigError) as exc:
        CacheConfig(method="kvzip", chunk=8)
    assert exc.value.param == "chunk"


def test_a_later_turn_reconstructs_only_what_no_pass_scored(tiny, cut_chunks):
    from qfserve.engine.kv.kvzip import Reconstruction

    loaded, tokens = tiny
    model, context = loaded.model, tokens[:-1]
    repeat = RepeatPrompt.for_tokenizer(loaded.tokenizer)
    caches = make_caches(model, CacheConfig(method="kvzip", budget=17, recent=2))
    model(mx.array(context[:30])[None], cache=caches)
    compress(model, caches, context[:30], repeat, chunk=CHUNK)
    before = [dict(zip(np.array(c.positions[0, 0]).tolist(), np.array(c.token_scores[0, 0]).tolist(), strict=True)) for c in caches]  # fmt: skip
    model(mx.array(context[30:])[None], cache=caches)  # the next turn's block
    run = Reconstruction(model, caches, context, repeat, chunk=CHUNK)
    assert run.first == 30 and run._plan[0][0] == 30  # only the new tokens, chunked from there
    while not run.done:
        run.step(8)
    for c, old in zip(caches, before, strict=True):
        assert c.size() == 17
        now = dict(zip(np.array(c.positions[0, 0]).tolist(), np.array(c.token_scores[0, 0]).tolist(), strict=True))  # fmt: skip
        for p, score in now.items():
            if p < 30:  # kept from the first turn: its score as the first pass gave it
                assert score == pytest.approx(old[p])
            else:
                assert score >= 0


RANK_SCRIPT = """
import json
from types import SimpleNamespace

import mlx.core as mx

from qfserve.engine.kv.kvzip.reconstruction import first_unscored

group = mx.distributed.init(strict=True, backend="ring")
# Each rank holds its own head's rows: scored (>= 0) rows 0-1, then rows no pass has
# scored; rank 0 has evicted position 5 of those, rank 1 kept it.
positions = [[0, 1, 6, 7]] if group.rank() == 0 else [[0, 1, 5, 7]]
cache = SimpleNamespace(token_scores=mx.array([[1.0, 1.0, -1.0, -1.0]]), valid=None,
                        positions=mx.array(positions))
print(json.dumps([first_unscored([cache], 8), first_unscored([cache], 8, group)]))
"""


def test_ranks_start_a_reconstruction_pass_at_the_same_position(tmp_path):
    """Split over ranks, each holds only its heads' rows, so the first row no pass has
    scored may differ between them; the pass must start at the first over all of them, or
    the ranks would feed different tokens through one split model."""
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"{testing.HOST}:{testing.free_port()}"] for _ in range(2)]))
    ranks = [
        subprocess.Popen([sys.executable, "-c", RANK_SCRIPT], stdout=subprocess.PIPE,
                         env={**os.environ, "MLX_RANK": str(r), "MLX_HOSTFILE": str(hosts)})
        for r in range(2)
    ]  # fmt: skip
    outs = [json.loads(r.communicate(timeout=60)[0]) for r in ranks]
    assert [local for local, _ in outs] == [6, 5]  # what each rank sees alone
    assert [agreed for _, agreed in outs] == [5, 5]
