"""KVzap against independent references: the KVzip+ targets against an explicit numpy
computation on the layers' own inputs, the surrogates against a numpy forward of their weights
and a least-squares ridge, the surrogate file's refusals, and the eviction cache kept by the
surrogate's scores against the full cache's rows at the positions a numpy ranking keeps."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache
from safetensors.numpy import save_file

from qfserve.calibrations.kvzap.surrogate import (
    RidgeSums,
    Surrogate,
    SurrogateError,
    read_surrogate,
    save_surrogate,
    spearman,
    train_mlp,
)
from qfserve.calibrations.kvzap.targets import text_targets
from qfserve.calibrations.repeat import RepeatPrompt
from qfserve.engine.kv.config import CacheConfig, ConfigError
from qfserve.engine.kv.factory import make_caches
from tests.tiny import make_tiny_model

REPEAT = RepeatPrompt(first=(7, 8, 9), next=(10,), suffix=(11, 12))
CONTEXT = [int(t) for t in np.random.default_rng(0).integers(20, 500, size=40)]


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=3)


def layer_inputs(model, ids):
    """Per layer: the input norm's output ``(T, D)``, queries ``(Hq, T, d)`` and the cache's
    keys and values ``(H, T, d)``, each layer run by mlx-lm's own modules one at a time."""
    h = model.model.embed_tokens(mx.array(ids)[None])
    mask = create_attention_mask(h, None)
    out = []
    for layer in model.model.layers:
        attn = layer.self_attn
        x = layer.input_layernorm(h)
        q = attn.q_proj(x).reshape(1, len(ids), attn.n_heads, -1).transpose(0, 2, 1, 3)
        q = attn.rope(q)
        cache = KVCache()
        h = layer(h, mask, cache)
        out.append(
            (
                np.array(x[0]),
                np.array(q[0]),
                np.array(cache.keys[0, :, : len(ids)]),
                np.array(cache.values[0, :, : len(ids)]),
            )
        )
    return out


def reference_targets(model, context, repeat):
    """KVzip+ by its definition: explicit softmax over every causal key, each query's
    attention divided by its hidden state's norm, each key weighted by ``|W_O^h v|``, the
    max over the repeated context's queries and the group's heads, then the log."""
    lead = [*repeat.first, *repeat.suffix]
    ids = [*context, *lead, *context]
    C, sr = len(context), len(context) + len(lead)
    targets, hidden = [], []
    for layer, (x, q, k, v) in zip(model.model.layers, layer_inputs(model, ids), strict=True):
        attn = layer.self_attn
        Hq, H = q.shape[0], k.shape[0]
        g = Hq // H
        wo = np.array(attn.o_proj.weight)  # (hidden, Hq * d)
        d = v.shape[-1]
        y = np.full((C, H), -np.inf)
        for head in range(Hq):
            kv = head // g
            w = wo[:, head * d : (head + 1) * d]
            value_norm = np.linalg.norm(v[kv, :C] @ w.T, axis=-1)  # (C,)
            for t in range(sr, sr + C):
                logits = q[head, t] @ k[kv, : t + 1].T * attn.scale
                p = np.exp(logits - logits.max())
                p /= p.sum()
                share = p[:C] / np.linalg.norm(x[t]) * value_norm
                y[:, kv] = np.maximum(y[:, kv], np.log(share))
        targets.append(y)
        hidden.append(x[:C])
    return hidden, targets


def test_targets_equal_an_independent_numpy_reference(model):
    got = text_targets(model, CONTEXT, REPEAT)
    hidden, targets = reference_targets(model, CONTEXT, REPEAT)
    for i in range(len(targets)):
        np.testing.assert_allclose(got.hidden[i], hidden[i], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got.targets[i], targets[i], rtol=1e-4, atol=1e-4)
    # A target is not a constant: keys differ in what the reconstruction reads.
    assert np.std(got.targets[0]) > 0.1


def numpy_forward(x, weights):
    if len(weights) == 2:
        w, b = weights
        return x @ w + b
    w1, b1, w2, b2 = weights
    a = x @ w1 + b1
    gelu = 0.5 * a * (1 + np.vectorize(math.erf)(a / math.sqrt(2)))
    return gelu @ w2 + b2


def random_surrogate(form, L=2, D=128, H=2, seed=0):
    rng = np.random.default_rng(seed)
    if form == "linear":
        weights = {"w": rng.normal(size=(L, D, H)) * 0.1, "b": rng.normal(size=(L, H))}
    else:
        weights = {
            "w1": rng.normal(size=(L, D, 16)) * 0.1,
            "b1": rng.normal(size=(L, 16)) * 0.1,
            "w2": rng.normal(size=(L, 16, H)) * 0.1,
            "b2": rng.normal(size=(L, H)),
        }
    weights = {k: v.astype(np.float32) for k, v in weights.items()}
    return Surrogate(form, weights, [True] * L, "tiny", "fp")


@pytest.mark.parametrize("form", ["linear", "mlp"])
def test_a_surrogate_is_its_weights_numpy_forward(form):
    s = random_surrogate(form)
    x = np.random.default_rng(1).normal(size=(5, 128)).astype(np.float32)
    for i in range(2):
        names = ("w", "b") if form == "linear" else ("w1", "b1", "w2", "b2")
        expected = numpy_forward(x, [s.weights[k][i] for k in names])
        np.testing.assert_allclose(s.predict(i, x), expected, rtol=1e-5, atol=1e-5)


def test_ridge_equals_the_least_squares_solution():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(300, 6))
    y = x @ rng.normal(size=(6, 2)) + 0.3 + rng.normal(size=(300, 2)) * 0.1
    sums = RidgeSums(6, 2)
    for part in np.array_split(np.arange(300), 4):
        sums.add(x[part], y[part])
    w, b = sums.solve(alpha=2.0)
    # The centred problem, solved as one stacked least-squares system.
    xc, yc = x - x.mean(0), y - y.mean(0)
    stacked = np.vstack([xc, math.sqrt(2.0) * np.eye(6)])
    target = np.vstack([yc, np.zeros((6, 2))])
    ref = np.linalg.lstsq(stacked, target, rcond=None)[0]
    np.testing.assert_allclose(w, ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(b, y.mean(0) - x.mean(0) @ ref, rtol=1e-4, atol=1e-5)


def test_the_mlp_learns_a_function_it_can_represent():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2048, 2, 8)).astype(np.float32)
    y = np.tanh(x[..., :2] * 1.5) + x[..., 2:4] ** 2 * 0.3
    before = np.mean((y - y.mean(0)) ** 2)
    weights = train_mlp(x, y, hidden=32, epochs=20, batch=128, lr=1e-2)
    s = Surrogate("mlp", weights, [True, True])
    pred = np.stack([s.predict(i, x[:, i]) for i in range(2)], axis=1)
    assert np.mean((pred - y) ** 2) < 0.2 * before
    assert spearman(pred.ravel(), y.ravel()) > 0.9


def test_spearman_is_the_rank_correlation():
    a = np.array([0.1, 0.5, 0.2, 0.9])
    assert spearman(a, a**3) == pytest.approx(1.0)
    assert spearman(a, -a) == pytest.approx(-1.0)
    # ranks (0, 2, 1, 3) against (1, 0, 2, 3): 1 - 6 * 6 / (4 * 15)
    assert spearman(a, np.array([2.0, 1.0, 3.0, 4.0])) == pytest.approx(0.4)


def test_the_mlp_is_written_only_where_it_ranks_clearly_better():
    """The MLP costs ~100x the linear map's bytes: it is chosen only past the margin."""
    from qfserve.calibrations.kvzap.train import MLP_MARGIN, choose

    def trained(linear: float, mlp: float) -> dict[str, Surrogate]:
        out = {"linear": random_surrogate("linear"), "mlp": random_surrogate("mlp")}
        out["linear"].fidelity, out["mlp"].fidelity = (
            {"spearman_median": linear},
            {"spearman_median": mlp},
        )
        return out

    assert choose(trained(0.708, 0.716)).form == "linear"  # Gemma 3 270M's measures
    assert choose(trained(0.70, 0.70 + MLP_MARGIN + 0.01)).form == "mlp"
    assert choose(trained(0.78, 0.76)).form == "linear"
    assert choose({"mlp": trained(0.5, 0.6)["mlp"]}).form == "mlp"


def test_surrogate_files_round_trip_and_bad_ones_are_refused_by_name(tmp_path):
    s = random_surrogate("mlp")
    s.fidelity = {"spearman_median": 0.8}
    path = save_surrogate(tmp_path / "m.kvzap", s)
    back = read_surrogate(path, fingerprint="fp")
    assert back.form == "mlp" and back.fidelity == s.fidelity and back.layers == s.layers
    for k in s.weights:
        np.testing.assert_array_equal(back.weights[k], s.weights[k])
    with pytest.raises(SurrogateError, match="other weights") as err:
        read_surrogate(path, fingerprint="another")
    assert str(path) in str(err.value)
    torn = tmp_path / "torn.kvzap"
    torn.write_bytes(path.read_bytes()[:100])
    with pytest.raises(SurrogateError, match="not a readable") as err:
        read_surrogate(torn)
    assert str(torn) in str(err.value)
    other = tmp_path / "other.kvzap"
    save_file({"w": np.zeros((1, 2), np.float32)}, other, {"format": "something else"})
    with pytest.raises(SurrogateError, match="not a KVzap surrogate"):
        read_surrogate(other)
    nan = random_surrogate("linear")
    nan.weights["b"][0, 0] = np.nan
    with pytest.raises(SurrogateError, match="NaN"):
        read_surrogate(save_surrogate(tmp_path / "nan.kvzap", nan))


def numpy_keep(scores, budget, n_sink, recent):
    """Per head, the kept positions: protected rows, then the highest scores."""
    H, L = scores.shape
    ranked = scores.copy()
    ranked[:, :n_sink] = np.inf
    ranked[:, L - recent :] = np.inf
    return [sorted(sorted(range(L), key=lambda j: (-ranked[h, j], j))[:budget]) for h in range(H)]


def kept_positions(cache_keys, full_keys):
    """Per head, the positions of the full cache whose rows the cache holds."""
    out = []
    for h in range(full_keys.shape[0]):
        rows = {full_keys[h, p].tobytes(): p for p in range(full_keys.shape[1])}
        out.append(sorted(rows[r.tobytes()] for r in cache_keys[h]))
    return out


@pytest.mark.parametrize("recent", [0, 6])
def test_the_cache_keeps_the_budget_the_surrogate_ranks_first(model, recent):
    s = random_surrogate("linear", seed=4)
    budget, n_sink = 16, 2
    config = CacheConfig(method="kvzap", budget=budget, recent=recent, n_sink=n_sink)
    caches = make_caches(model, config, surrogate=s)
    full = [KVCache() for _ in model.layers]
    model(mx.array(CONTEXT)[None], cache=full)
    model(mx.array(CONTEXT)[None], cache=caches)
    inputs = layer_inputs(model, CONTEXT)
    for i, (cache, plain) in enumerate(zip(caches, full, strict=True)):
        scores = numpy_forward(inputs[i][0], (s.weights["w"][i], s.weights["b"][i])).T
        expected = numpy_keep(scores, budget, n_sink, recent)
        assert cache.size() == budget and cache.offset == len(CONTEXT)
        got = kept_positions(np.array(cache.keys[0]), np.array(plain.keys[0]))
        assert got == expected


def test_decode_steps_are_scored_by_the_surrogate_and_stay_bounded(model):
    s = random_surrogate("mlp", seed=5)
    caches = make_caches(model, CacheConfig(method="kvzap", budget=12, recent=2), surrogate=s)
    model(mx.array(CONTEXT[:20])[None], cache=caches)
    for t in CONTEXT[20:]:
        model(mx.array([[t]]), cache=caches)
        assert all(c.size() <= 13 for c in caches)  # the budget and the step's free slot
    assert all(c.evictions > 0 for c in caches)


def test_a_budget_above_the_prompt_generates_as_the_full_cache(model):
    s = random_surrogate("linear")
    caches = make_caches(model, CacheConfig(method="kvzap", budget=200, recent=8), surrogate=s)
    full = [KVCache() for _ in model.layers]
    a = model(mx.array(CONTEXT)[None], cache=caches)
    b = model(mx.array(CONTEXT)[None], cache=full)
    np.testing.assert_array_equal(np.array(a), np.array(b))
    for _ in range(8):
        nxt = mx.argmax(a[:, -1:], axis=-1)
        assert nxt.item() == mx.argmax(b[:, -1:], axis=-1).item()
        a, b = model(nxt, cache=caches), model(nxt, cache=full)


def test_kvzap_without_surrogates_is_refused_naming_the_method(model):
    with pytest.raises(ConfigError, match="qfserve calibrate --kvzap") as err:
        make_caches(model, CacheConfig(method="kvzap", budget=16, recent=4))
    assert err.value.param == "method"


@pytest.mark.parametrize("form", ["linear", "mlp"])
def test_fused_decode_steps_are_scored_by_the_surrogate_too(form):
    """On the served model the decode step of a block is one fused native op, which computes
    the input norm itself: the tap keeps the row before the norm, and each decode row's
    stored score is the surrogate's of its own normalised hidden state (numpy reference:
    the RMS norm and the surrogate's weights), computed by the eviction step itself for a
    linear surrogate and by MLX for an MLP (else the row would rank by the fallback, below
    every prompt row)."""
    from qfserve.calibrations.kvzap.hidden import HiddenTap
    from qfserve.engine.models.loading import load_model

    loaded = load_model(None)
    if not any(type(b).__name__.startswith("Fused") for b in loaded.model.layers):
        pytest.skip("the native kernels are not built here: no fused decode block")
    args = loaded.model.args
    s = random_surrogate(
        form, L=args.num_hidden_layers, D=args.hidden_size, H=args.num_key_value_heads
    )
    config = CacheConfig(method="kvzap", budget=24, recent=4)
    caches = make_caches(loaded.model, config, surrogate=s)
    prompt = loaded.tokenizer.encode("The pass key is 4821. Remember it well, and keep it. " * 3)
    loaded.model(mx.array(prompt)[None], cache=caches)
    kept: dict[int, tuple] = {}
    defer = HiddenTap.defer

    def keep(tap, x, weight, eps):
        kept[id(tap)] = (np.array(x, dtype=np.float64)[0, 0], np.array(weight), eps)
        defer(tap, x, weight, eps)

    HiddenTap.defer = keep
    try:
        for token in (11, 12, 13, 14):
            loaded.model(mx.array([[token]]), cache=caches)
            mx.eval([c.state for c in caches])
            for layer, cache in enumerate(caches):
                x, weight, eps = kept[id(cache.scorer.tap)]
                h = x / np.sqrt(np.mean(x**2) + eps) * weight
                w = {k: v[layer].astype(np.float64) for k, v in s.weights.items()}
                if form == "linear":
                    want = h @ w["w"] + w["b"]
                else:
                    u = h @ w["w1"] + w["b1"]
                    gelu = 0.5 * u * (1 + np.vectorize(math.erf)(u / math.sqrt(2)))
                    want = gelu @ w["w2"] + w["b2"]
                at = np.array(cache.order[0]) == cache.offset - 1  # the row's slot, per head
                got = np.array(cache.scores[0])[at]
                np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3, err_msg=str(layer))
    finally:
        HiddenTap.defer = defer
    assert all(cache.evictions > 0 for cache in caches)


def numpy_layer_keep(scores, budget, n_sink, recent):
    """Rows shared across layers by their definition, given out one at a time: every head of
    a layer keeps the same count, and each next row a head goes to the layer whose heads'
    best next row scores highest (protected rows, sinks and the recent window, first),
    until the layers hold ``budget`` rows a head on average; a head keeps its best rows."""
    ranked = []
    for s in scores:
        r = s.astype(np.float64).copy()
        r[:, :n_sink] = np.inf
        r[:, s.shape[1] - recent :] = np.inf
        ranked.append(-np.sort(-r, axis=-1))  # each head's rows, best first
    rows = [0] * len(scores)
    for _ in range(budget * len(scores)):
        worth = [
            r[:, n].max() if n < r.shape[1] else -np.inf for r, n in zip(ranked, rows, strict=True)
        ]
        rows[int(np.argmax(worth))] += 1
    out = []
    for s, n in zip(scores, rows, strict=True):
        r = s.astype(np.float64).copy()
        r[:, :n_sink] = np.inf
        r[:, s.shape[1] - recent :] = np.inf
        out.append([sorted(np.argsort(-r[h], kind="stable")[:n].tolist()) for h in range(len(r))])
    return out


def held_positions(cache, full_keys):
    """Per head, the positions of the full cache whose rows the cache holds (real rows only)."""
    keys = np.array(cache.keys[0])
    valid = np.ones(keys.shape[:2], bool) if cache.valid is None else np.array(cache.valid[0])
    rows = [keys[h][valid[h]] for h in range(keys.shape[0])]
    out = []
    for h, held in enumerate(rows):
        at = {full_keys[h, p].tobytes(): p for p in range(full_keys.shape[1])}
        out.append(sorted(at[r.tobytes()] for r in held))
    return out


def global_caches(model, s, budget=10, recent=3, n_sink=2):
    config = CacheConfig(
        method="kvzap", budget=budget, recent=recent, n_sink=n_sink, budget_mode="global"
    )
    return config, make_caches(model, config, surrogate=s)


def test_shared_rows_go_to_the_layers_whose_heads_score_them_highest(model):
    """``budget_mode="global"``: the layers share ``budget x layers`` rows a head, every
    head of a layer keeping the same count, by the predicted scores (a layer may keep more
    than the budget, another fewer), protected rows first: as a numpy reference that gives
    them out one at a time."""
    from qfserve.engine.kv.kvzap import share

    s = random_surrogate("linear", seed=6)
    config, caches = global_caches(model, s)
    full = [KVCache() for _ in model.layers]
    model(mx.array(CONTEXT)[None], cache=full)
    model(mx.array(CONTEXT)[None], cache=caches)
    assert all(c.size() == len(CONTEXT) for c in caches)  # stored whole until shared
    share(caches)
    inputs = layer_inputs(model, CONTEXT)
    scores = [
        numpy_forward(inputs[i][0], (s.weights["w"][i], s.weights["b"][i])).T
        for i in range(len(caches))
    ]
    expected = numpy_layer_keep(scores, config.budget, config.n_sink, config.recent)
    got = [held_positions(c, np.array(f.keys[0])) for c, f in zip(caches, full, strict=True)]
    assert got == expected
    kept = [len(layer[0]) for layer in got]
    assert sum(kept) == config.budget * len(kept)
    assert len(set(kept)) > 1  # shared unevenly
    assert all(c.valid is None for c in caches)  # a layer's heads keep the same count


def test_shared_rows_read_in_chunks_stay_bounded_and_decode_in_place(model):
    """The server shares the rows out after every chunk read: the layers then hold at most
    ``budget`` rows a head on average (and a chunk while it is read), what the request
    reserves; decode keeps each layer's share, one row a head evicted as one joins."""
    from qfserve.engine.kv.kvzap import share

    s = random_surrogate("mlp", seed=7)
    config, caches = global_caches(model, s)
    chunk = 12
    bound = config.budget * len(caches)
    for at in range(0, len(CONTEXT), chunk):
        model(mx.array(CONTEXT[at : at + chunk])[None], cache=caches)
        assert sum(c.size() for c in caches) <= bound + chunk * len(caches)
        share(caches)
        assert sum(c.size() for c in caches) <= bound
    assert all(c.offset == len(CONTEXT) for c in caches)
    sizes = [c.size() for c in caches]
    assert len(set(sizes)) > 1
    for t in CONTEXT[:10]:
        model(mx.array([[t]]), cache=caches)
        assert [c.size() for c in caches] == sizes


def test_decode_rows_are_stored_beside_the_shares_then_shared_out(model):
    """Before decoding the layers share ``budget`` rows a head (the numpy reference); each
    stores ``room`` decode rows whole beside its share, then evicts a row a step, and every
    ``DECODE_SHARE_PERIOD`` rooms they share again over every row held (the reference again,
    on the rows' stored scores): a head holds at most ``budget + room`` rows on average over
    the layers, what the request reserves."""
    from qfserve.engine.kv.kvzap import (
        DECODE_SHARE_PERIOD,
        KVzapPolicy,
        decode_room,
        share,
        share_in_decode,
    )

    s = random_surrogate("linear", seed=8)
    budget = 16
    config, caches = global_caches(model, s, budget=budget)
    room = decode_room(budget)
    assert room == budget // 8
    assert KVzapPolicy.reserved_rows(budget, config, prefill_chunk=1) == budget + room + 1
    full = [KVCache() for _ in model.layers]
    model(mx.array(CONTEXT)[None], cache=full)
    model(mx.array(CONTEXT)[None], cache=caches)
    share(caches, decode=True)
    inputs = layer_inputs(model, CONTEXT)
    scores = [
        numpy_forward(inputs[i][0], (s.weights["w"][i], s.weights["b"][i])).T
        for i in range(len(caches))
    ]
    expected = numpy_layer_keep(scores, budget, config.n_sink, config.recent)
    got = [held_positions(c, np.array(f.keys[0])) for c, f in zip(caches, full, strict=True)]
    assert got == expected
    shares_at = [len(layer[0]) for layer in got]
    assert [c.budget for c in caches] == [n + room for n in shares_at]
    period, bound, shares = DECODE_SHARE_PERIOD * room, (budget + room) * len(caches), 0
    for step in range(1, 2 * period + 1):
        model(mx.array([[step + 7]]), cache=caches)
        held = [c.size() for c in caches]
        assert sum(held) <= bound
        # room rows stored whole, then one evicted a step at the share and the room
        assert held == [n + min(step - shares * period, room) for n in shares_at]
        stored = None
        if step % period == 0:  # the rows' stored scores, in temporal order, as shared
            for c in caches:
                c.prepare_compress()
            stored = [np.array(c.token_scores[0]) for c in caches]
        share_in_decode(caches, step)
        if stored is not None:
            shares += 1
            want = numpy_layer_keep(stored, budget, config.n_sink, config.recent)
            shares_at = [len(layer[0]) for layer in want]
            assert [c.size() for c in caches] == shares_at
    assert shares == 2
    assert all(c.offset == len(CONTEXT) + 2 * period for c in caches)


def test_only_methods_whose_scores_rank_across_layers_share_rows():
    CacheConfig(method="kvzap", budget=16, budget_mode="global")
    with pytest.raises(ConfigError, match="kvzip.*kvzap") as err:
        CacheConfig(method="qfilters", budget=16, budget_mode="global")
    assert err.value.param == "budget_mode"


def test_shared_rows_reserve_the_budget_and_a_chunk(model):
    """The layers share ``budget`` rows a head on average: a request sharing its rows
    reserves them and the chunk it reads beside them, against per-head budgets' ``budget``;
    both with the decode step's slot."""
    from types import SimpleNamespace

    from qfserve.engine.kv.kvzap import KVzapPolicy
    from qfserve.engine.kv.memory import kv_row_bytes
    from qfserve.engine.kv.methods import MethodContext

    loaded = SimpleNamespace(model=model, config={})
    s = random_surrogate("linear")
    context = MethodContext(model=model, tokenizer=None)
    needs = {}
    for mode in ("per_head", "global"):
        config = CacheConfig(method="kvzap", budget=40, recent=8, budget_mode=mode)
        policy = KVzapPolicy(config, make_caches(model, config, surrogate=s), context)
        reserved = policy.reserve(
            loaded, 2000, 16, max_kv_bytes=2**40, prefill_chunk=64, kept=False
        )
        needs[mode] = reserved.need // kv_row_bytes(model, {}, config)
        assert reserved.param == "budget"
    assert needs == {"per_head": 40 + 1, "global": 40 + 64 + 1 + 1}
