"""A decode step's transformer block as two native ops around its cache and attention
(qfserve.engine.models.fused): the same logits bit for bit as the single ops, for every cache
a decode step meets (full, evicting past its budget, a batch of two), two fused calls per
layer and step, the class's own forward for prompt blocks, and a query tap on the rope handed
what the class's forward would hand it."""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from qfserve.calibrations.model_info import head_counts
from qfserve.engine.kv import attention
from qfserve.engine.kv.batch import BatchCache
from qfserve.engine.kv.config import CacheConfig
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.models import fused
from qfserve.engine.models.quantized import detach
from tests.engine.test_gguf import load_served
from tests.gguf_families import write_family_gguf
from tests.gguf_files import load_converted_tiny
from tests.kernels.conftest import _buildable

pytestmark = pytest.mark.skipif(bool(_buildable()), reason=str(_buildable()))
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture(scope="module", params=[GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0])
def tiny(request, tmp_path_factory):
    """A tiny GGUF whose every projection is quantized, loaded as the server loads it."""
    loaded = load_converted_tiny(tmp_path_factory.mktemp("fused"), PROJECTIONS, request.param)
    # Norm weights of their own (the tiny model's are all ones), so that a norm read in the
    # wrong place shows.
    model = loaded.model
    kernel = model.layers[0]._qfserve_parts.kernel
    rng = np.random.default_rng(5)
    for layer in model.layers:
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            shape = norm.weight.shape
            norm.plain.weight = mx.array(rng.uniform(0.5, 1.5, shape).astype(np.float32))
    assert fused.install(model, kernel) == len(model.layers)  # again: reads the new weights
    yield loaded
    detach(loaded.model)


def decode(model, config: CacheConfig, prompts: list[list[int]], steps: int) -> np.ndarray:
    """Greedy logits of ``steps`` decode steps after each prompt, the prompts' caches stepped
    together (a packed batch) when there are several."""
    filters = None
    if config.method == "qfilters":  # the tiny model has no calibration: filters of its shape
        _, n_kv_heads, head_dim = head_counts(model.layers[0].self_attn, model)
        shape = (len(model.layers), n_kv_heads, head_dim)
        filters = mx.array(np.random.default_rng(1).standard_normal(shape).astype(np.float32))
    members = [make_caches(model, config, filters=filters) for _ in prompts]
    for caches, prompt in zip(members, prompts, strict=True):
        mx.eval(model(mx.array([prompt]), cache=caches))
    layers = members[0] if len(prompts) == 1 else [
        BatchCache([m[i] for m in members]) for i in range(len(model.layers))
    ]  # fmt: skip
    y = mx.array([[p[-1]] for p in prompts])
    out = []
    for _ in range(steps):
        logits = model(y, cache=layers)[:, -1]
        y = mx.argmax(logits, axis=-1)[:, None]
        out.append(np.array(logits))
    return np.stack(out)


PROMPTS = [[5, 9, 3, 7, 1, 2, 8] * 3, [4, 4, 6, 1, 9] * 4]


def unfused(model, run):
    """``run()`` with the model's blocks on their classes' own forward (the single ops), the
    fused path put back after."""
    kernel = model.layers[0]._qfserve_parts.kernel
    assert fused.remove(model) == len(model.layers)
    try:
        return run()
    finally:
        assert fused.install(model, kernel) == len(model.layers)


CONFIGS = [
    CacheConfig(method="full"),
    CacheConfig(method="qfilters", budget=24, recent=6, n_sink=2),
    CacheConfig(method="knorm", budget=24, recent=6, n_sink=2, chunk=4),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.method)
@pytest.mark.parametrize("batch", [1, 2])
def test_fused_steps_give_the_single_ops_logits_bit_for_bit(tiny, config, batch):
    model = tiny.model
    prompts = PROMPTS[:batch]
    got = decode(model, config, prompts, 20)
    np.testing.assert_array_equal(got, unfused(model, lambda: decode(model, config, prompts, 20)))


def count_fused_calls(model, monkeypatch) -> list[str]:
    """Every layer's fused ops through a kernel that records each call ("qkv", "tail") in the
    list returned; ``monkeypatch.undo()`` puts the layers' own kernel back."""
    kernel = model.layers[0]._qfserve_parts.kernel
    calls: list[str] = []

    class Counting:
        def decode_qkv(self, *args, **kwargs):
            calls.append("qkv")
            return kernel.decode_qkv(*args, **kwargs)

        def decode_tail(self, *args, **kwargs):
            calls.append("tail")
            return kernel.decode_tail(*args, **kwargs)

    for layer in model.layers:
        parts = layer._qfserve_parts
        monkeypatch.setattr(layer, "_qfserve_parts", replace(parts, kernel=Counting()))
    return calls


def test_two_fused_calls_a_layer_and_decode_step_and_none_for_a_block(tiny, monkeypatch):
    model = tiny.model
    calls = count_fused_calls(model, monkeypatch)
    caches = make_caches(model, CacheConfig(method="full"))
    mx.eval(model(mx.array([[5, 9, 3, 7, 1, 2]]), cache=caches))
    assert calls == []  # a prompt block runs the class's own forward
    mx.eval(model(mx.array([[4]]), cache=caches))
    assert calls == ["qkv", "tail"] * len(model.layers)


def _tapped_decode(model) -> list[np.ndarray]:
    """The queries a tap on every layer's rope sees over a prompt and two decode steps."""
    from qfserve.calibrations.capture import QueryRoPE

    seen: list[np.ndarray] = []
    ropes = [layer.self_attn.rope for layer in model.layers]
    for layer, rope in zip(model.layers, ropes, strict=True):
        attn = layer.self_attn
        attn.rope = QueryRoPE(rope, lambda q, _: seen.append(q), attn.n_heads, attn.n_kv_heads)
    try:
        caches = make_caches(model, CacheConfig(method="full"))
        mx.eval(model(mx.array([[5, 9, 3]]), cache=caches))
        for token in (4, 7):
            mx.eval(model(mx.array([[token]]), cache=caches))
    finally:
        for layer, rope in zip(model.layers, ropes, strict=True):
            layer.self_attn.rope = rope
    return [np.array(q) for q in seen]


def test_a_tapped_rope_keeps_the_fused_path_and_sees_the_same_queries(tiny, monkeypatch):
    """Self-calibration and traffic sampling tap every layer's rope: the fused step hands the
    tap the queries it rotated, the same bit for bit as the class's own forward hands it."""
    model = tiny.model
    calls = count_fused_calls(model, monkeypatch)
    got = _tapped_decode(model)
    assert calls == ["qkv", "tail"] * (2 * len(model.layers))  # both steps fused, taps and all
    monkeypatch.undo()
    want = unfused(model, lambda: _tapped_decode(model))
    assert [q.shape for q in got] == [q.shape for q in want]
    assert [q.shape[2] for q in got[-len(model.layers) :]] == [1] * len(model.layers)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def test_blocks_with_a_projection_bias_keep_their_forward(tiny):
    """What the fused ops do not compute (here a bias on o) leaves the block as it was."""
    model = tiny.model
    kernel = model.layers[0]._qfserve_parts.kernel
    fused.remove(model)
    o = model.layers[1].self_attn.o_proj
    o.bias = mx.zeros((o.weight.shape[0],))
    try:
        assert fused.install(model, kernel) == len(model.layers) - 1
        assert not hasattr(model.layers[1], "_qfserve_parts")
    finally:
        fused.remove(model)
        del o["bias"]
        fused.install(model, kernel)


ALL = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def family(request, tmp_path_factory):
    """A tiny Qwen3 or Gemma 3 GGUF whose every projection is quantized, loaded as served."""
    scratch = tmp_path_factory.mktemp(request.param)
    path = scratch / f"{request.param}.gguf"
    write_family_gguf(path, request.param, quantized=(*ALL, "token_embd", "output"))
    from qfserve.engine.models.gguf.convert import converted_folder

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QFSERVE_CACHE", str(scratch / "cache"))
        folder = converted_folder(path)
    loaded = load_served(folder)
    yield request.param, loaded
    detach(loaded.model)


@pytest.mark.parametrize("config", CONFIGS[:2], ids=lambda c: c.method)
@pytest.mark.parametrize("batch", [1, 2])
def test_qwen3_and_gemma3_blocks_are_fused_and_decode_as_their_single_ops(
    family, config, batch, monkeypatch
):
    """Qwen3's head norms and Gemma 3's (with its post norms, ``1 + w`` scales and GELU MLP)
    in the fused ops, two calls a layer and step: the logits are the single ops' bit for bit.
    Gemma's sliding layers (rotating caches) and its global ones both take the path."""
    _, loaded = family
    model = loaded.model
    calls = count_fused_calls(model, monkeypatch)
    prompts = PROMPTS[:batch]
    got = decode(model, config, prompts, 12)
    assert calls == ["qkv", "tail"] * (12 * len(model.layers))
    monkeypatch.undo()
    np.testing.assert_array_equal(got, unfused(model, lambda: decode(model, config, prompts, 12)))


def test_a_block_installed_under_a_query_tap_is_fused(family):
    """Installing again while a tap wraps the rope (self-calibration) keeps the fused path."""
    from qfserve.calibrations.capture import QueryRoPE

    _, loaded = family
    model = loaded.model
    kernel = model.layers[0]._qfserve_parts.kernel
    attn = model.layers[0].self_attn
    rope = attn.rope
    attn.rope = QueryRoPE(rope, lambda q, _: None, attn.n_heads, attn.n_kv_heads)
    try:
        assert fused.install(model, kernel) == len(model.layers)
        assert model.layers[0]._qfserve_parts.rope is rope
    finally:
        attn.rope = rope
        fused.install(model, kernel)


def test_gemma3_sliding_layers_read_their_prompt_chunks_natively(family, monkeypatch):
    """A prompt read in chunks past Gemma 3's sliding window: each local layer's chunk goes
    through the kernel's windowed prefill attention (not MLX's whole-array fallback), and the
    logits are those of MLX's own attention under mlx-lm's window mask."""
    name, loaded = family
    if name != "gemma3":
        pytest.skip("Qwen3 has no sliding window")
    model = loaded.model
    window = model.args.sliding_window
    prompt = [int(t) for t in np.random.default_rng(2).integers(5, 60, size=40)]
    chunk = 2 * window  # every chunk reaches past the window

    def read() -> np.ndarray:
        caches = model.make_cache()
        out = [model(mx.array([prompt[i : i + chunk]]), cache=caches) for i in range(0, 40, chunk)]
        return np.concatenate([np.array(o[0]) for o in out])

    windows: list[int] = []
    kernel = model.layers[0]._qfserve_parts.kernel
    prefill = kernel.prefill_attention

    class Spy:
        def __getattr__(self, name):
            return getattr(kernel, name)

        @staticmethod
        def prefill_attention(*args, window=0, **kwargs):
            windows.append(window)
            return prefill(*args, window=window, **kwargs)

    attention.install_head_masks(model)  # as the server does at start-up
    monkeypatch.setattr(attention, "_NATIVE", {"kernel": Spy()})
    got = read()
    local = sum(layer.self_attn.is_sliding for layer in model.layers)
    assert local and windows.count(window) == local * len(range(0, 40, chunk))
    monkeypatch.setattr(attention, "_NATIVE", {"kernel": None})
    np.testing.assert_allclose(got, read(), rtol=1e-4, atol=1e-4)
