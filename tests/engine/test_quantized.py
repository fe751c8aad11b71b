"""Quantized weights held as codes on the CPU (qfserve.engine.models.quantized): the loader
gives exactly the quantized layers the native kernel's subclasses, few rows and many read the
codes (no float32 copy), decode steps attend through the native kernel, and greedy text is
that of the float32 model with MLX's attention (the tiny model here; SmolLM2 for every
eviction method)."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType
from mlx_lm.generate import generate_step

from qfserve.engine.kv import attention
from qfserve.engine.kv.batch import BatchCache
from qfserve.engine.kv.config import METHODS, CacheConfig
from qfserve.engine.kv.factory import make_caches
from qfserve.engine.kv.kvzip import RepeatPrompt, compress
from qfserve.engine.models.fused import MAX_ROWS
from qfserve.engine.models.loading import _attach_codes, load_model
from qfserve.engine.models.quantized import (
    NativeQuantizedEmbedding,
    NativeQuantizedLinear,
    densify,
    detach,
    kernel_of,
    weight_bytes,
)
from tests.gguf_files import load_converted_tiny
from tests.kernels.conftest import _buildable, activations

pytestmark = pytest.mark.skipif(bool(_buildable()), reason=str(_buildable()))
QUANTIZED = ("attn_q", "attn_v", "ffn_up", "token_embd")


@pytest.fixture(scope="module", params=[GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q5_1])
def tiny(request, tmp_path_factory):
    """A tiny GGUF with some tensors quantized, converted in a scratch cache and loaded as
    the server loads it (the kernel itself is built once into qfserve's own cache)."""
    loaded = load_converted_tiny(tmp_path_factory.mktemp("tiny"), QUANTIZED, request.param)
    yield loaded
    detach(loaded.model)  # the native decode attention is one switch for the process


@pytest.fixture(scope="module")
def smollm2(smollm2_folder):
    loaded = load_model(str(smollm2_folder))
    yield loaded
    detach(loaded.model)


def wrapped(model: nn.Module) -> dict[str, nn.Module]:
    return {
        name: m
        for name, m in model.named_modules()
        if isinstance(m, NativeQuantizedLinear | NativeQuantizedEmbedding)
    }


def float32_reference(loaded, run):
    """``run(model)`` on a second copy of the model with float32 weights and MLX's own
    attention and layers; the native path is put back on ``loaded`` after."""
    plain = load_model(loaded.source).model
    detach(plain)  # the native attention is one switch for the process: off
    densify(plain)
    assert not wrapped(plain) and not any(
        isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding) for _, m in plain.named_modules()
    )
    try:
        return run(plain)
    finally:
        _attach_codes(loaded.model, loaded.source)


def test_exactly_the_quantized_tensors_read_codes_and_no_float32_copy_is_held(tiny):
    loaded = tiny
    stored = mx.load(f"{loaded.source}/model.safetensors")
    stems = {k.rsplit(".", 1)[0] for k in stored if k.endswith(".scales")}
    layers = len(loaded.model.model.layers)
    assert len(stems) == 3 * layers + 1  # attn_q, attn_v, ffn_up per layer; the embedding
    assert "model.layers.0.self_attn.q_proj" in stems and "model.embed_tokens" in stems
    assert "model.layers.0.self_attn.k_proj" not in stems  # F32 in the file
    assert set(wrapped(loaded.model)) == stems
    # Held: the folder's tensors, scales widened to float32 at most (no dequantized copy).
    assert weight_bytes(loaded.model) == sum(v.nbytes for v in stored.values())


@pytest.mark.parametrize("rows", [1, MAX_ROWS, MAX_ROWS + 1, 40])
def test_few_rows_and_many_read_the_codes(tiny, rows):
    module = tiny.model.model.layers[0].self_attn.q_proj
    assert isinstance(module, NativeQuantizedLinear)
    dense = np.array(
        mx.dequantize(module.weight, module.scales.astype(mx.float32),
                      module.biases.astype(mx.float32), group_size=module.group_size,
                      bits=module.bits), dtype=np.float64
    )  # fmt: skip
    x = mx.array(np.random.default_rng(rows).standard_normal((1, rows, dense.shape[1]), np.float32))
    with activations(module._qfserve_kernel, 0):  # float32 products: exact to rounding
        got = np.array(module(x))
    np.testing.assert_allclose(got, np.array(x, np.float64) @ dense.T, atol=2e-5)


def test_greedy_text_equals_the_float32_models(tiny):
    loaded = tiny
    prompt = mx.array(np.random.default_rng(3).integers(0, 200, 40).tolist())

    def greedy(model) -> tuple[list[int], np.ndarray]:
        steps = list(generate_step(prompt, model, max_tokens=24))
        return [int(t) for t, _ in steps], np.stack([np.array(lp) for _, lp in steps])

    with_codes, logprobs = greedy(loaded.model)
    plain, plain_logprobs = float32_reference(loaded, greedy)
    assert with_codes == plain and len(set(plain)) > 3
    # The default decode activations (31-bit integers where the CPU has VNNI or AVX2) keep float32's
    # precision; so does the float path.
    np.testing.assert_allclose(logprobs, plain_logprobs, atol=1e-4)
    with activations(kernel_of(loaded.model), 0):
        float_path, float_logprobs = greedy(loaded.model)
    assert float_path == plain
    np.testing.assert_allclose(float_logprobs, plain_logprobs, atol=1e-4)


def test_blocks_and_decode_steps_attend_through_the_native_kernels(tiny, monkeypatch):
    """One call a layer: the prompt block's to prefill attention, the step's to decode."""
    model = tiny.model
    kernel, shapes = attention._NATIVE["kernel"], []

    class Counting:
        def decode_attention(self, q, k, v, scale, key_mask=None):
            shapes.append(("decode", q.shape, k.shape))
            return kernel.decode_attention(q, k, v, scale, key_mask=key_mask)

        def prefill_attention(self, q, k, v, scale, key_mask=None, window=0):
            assert window == 0  # full-attention layers: causal only
            shapes.append(("prefill", q.shape, k.shape))
            return kernel.prefill_attention(q, k, v, scale, key_mask=key_mask)

    monkeypatch.setitem(attention._NATIVE, "kernel", Counting())
    caches = make_caches(model, CacheConfig(method="full"))
    heads, kv = model.args.num_attention_heads, model.args.num_key_value_heads
    mx.eval(model(mx.array([[5, 9, 3, 7, 1, 2]]), cache=caches))
    assert [(op, q[1:3], k[1:3]) for op, q, k in shapes] == [
        ("prefill", (heads, 6), (kv, 6))
    ] * len(caches)
    shapes.clear()
    mx.eval(model(mx.array([[4]]), cache=caches))
    assert [(op, q[1:3], k[1:3]) for op, q, k in shapes] == [("decode", (heads, 1), (kv, 7))] * len(
        caches
    )


def test_a_batch_of_unequal_caches_attends_through_the_native_kernel(tiny):
    """Two sequences of different lengths stepped as one packed batch: its mask is one per
    member (B, 1, S); each member's logits are those it gets alone."""
    model = tiny.model
    prompts = [[5, 9, 3, 7, 1, 2, 8] * 3, [4, 4, 6, 1, 9] * 2]

    def run(group: list[list[int]]) -> list[np.ndarray]:
        members = [make_caches(model, CacheConfig(method="full")) for _ in group]
        for caches, prompt in zip(members, group, strict=True):
            mx.eval(model(mx.array([prompt]), cache=caches))
        layers = [BatchCache([m[i] for m in members]) for i in range(len(model.layers))]
        y, out = mx.array([[p[-1]] for p in group]), []
        for _ in range(6):
            logits = model(y, cache=layers)[:, -1]
            y = mx.argmax(logits, axis=-1)[:, None]
            out.append(np.array(logits))
        return list(np.stack(out, axis=1))

    together = run(prompts)
    for member, prompt in zip(together, prompts, strict=True):
        np.testing.assert_allclose(member, run([prompt])[0], rtol=1e-5, atol=1e-5)


def test_detach_puts_back_plain_modules_and_mlx_attention(tiny):
    """attach also swaps the block's rope, norms and swiglu for the native ones (each layer's,
    inside a query tap too); detach puts every one back."""
    import sys

    from mlx_lm.models.activations import swiglu

    from qfserve.engine.kv.selfcal import install_query_taps
    from qfserve.engine.models.native_layers import NativeRMSNorm, NativeRoPE

    loaded = tiny
    model = loaded.model
    attn = model.model.layers[0].self_attn
    mlp_module = sys.modules[type(model.model.layers[0].mlp).__module__]
    count = len(wrapped(model))
    install_query_taps(model)  # ropes wrapped by taps, as a kvzip or self-calibrating cache does
    assert attention._NATIVE["kernel"] is not None
    assert isinstance(attn.rope.inner, NativeRoPE)
    assert isinstance(model.model.norm, NativeRMSNorm) and mlp_module.swiglu is not swiglu
    assert detach(model) == count and not wrapped(model)
    assert attention._NATIVE["kernel"] is None
    assert type(model.model.layers[0].self_attn.q_proj) is nn.QuantizedLinear
    assert type(attn.rope.inner) is nn.RoPE and type(model.model.norm) is nn.RMSNorm
    assert mlp_module.swiglu is swiglu
    _attach_codes(model, loaded.source)
    assert len(wrapped(model)) == count and isinstance(attn.rope.inner, NativeRoPE)


@pytest.mark.parametrize("method", METHODS)
def test_smollm2_greedy_text_is_unchanged_for_every_method(smollm2, method):
    """The default model with every eviction method, budget below the prompt: codes against
    the float32 weights, token for token."""
    loaded = smollm2
    model, tokenizer = loaded.model, loaded.tokenizer
    story = (
        "Mara kept the lighthouse on Gull Rock for eleven winters. Each night she counted the "
        "ships that passed, wrote their names in a blue ledger, and trimmed the lamp at two. "
        "The supply boat came on Thursdays with flour, oil and letters from her brother in "
        "Lisbon, who wanted her to move south. In the spring a storm tore the roof from the "
        "shed, and a fisherman named Tomas helped her mend it."
    )
    messages = [{"role": "user", "content": f"{story}\n\nRetell this story in your own words."}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    config = CacheConfig(method=method, budget=112 if method != "full" else 512)

    def greedy(model) -> list[int]:
        surrogate = None
        if method == "kvzap":  # the model's shipped surrogates
            from qfserve.calibrations.kvzap.surrogate import read_surrogate
            from qfserve.calibrations.registry import find_surrogate, model_id_for

            surrogate = read_surrogate(find_surrogate(model_id_for(loaded.model_id)))
        caches = make_caches(model, config, surrogate=surrogate)
        if method == "kvzip":
            model(mx.array(prompt[:-1])[None], cache=caches)
            compress(model, caches, prompt[:-1], RepeatPrompt.for_tokenizer(tokenizer))
            y, out = mx.array(prompt[-1:])[None], []
            for _ in range(16):
                y = mx.argmax(model(y, cache=caches)[:, -1], axis=-1)[None]
                out.append(int(y.item()))
            return out
        steps = generate_step(mx.array(prompt), model, prompt_cache=caches, max_tokens=16)
        return [int(t) for t, _ in steps]

    assert wrapped(model), "the default model decodes on its codes"
    with_codes = greedy(model)
    plain = float32_reference(loaded, greedy)
    assert with_codes == plain and len(set(plain)) > 3


@pytest.mark.parametrize(("bits", "group"), [(4, 64), (6, 128), (8, 32)])
def test_mlx_quantized_folders_read_their_codes_too(bits, group):
    """A model quantized as ``mlx_lm.convert -q`` does (MLX's own ``nn.quantize``, its group
    size and bits): attached, every layer reads its codes through the kernel, and the logits
    are MLX's own quantized model's."""
    from mlx.utils import tree_flatten

    from qfserve.engine.models.gguf.convert import cache_root
    from qfserve.engine.models.quantized import attach
    from qfserve.kernels import native
    from tests.tiny import make_tiny_model

    model = make_tiny_model(0)
    nn.quantize(model, group_size=group, bits=bits)
    tokens = mx.array([[5, 9, 3, 7, 1, 2, 8, 4]])
    want = np.array(model(tokens))
    held = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    try:
        assert attach(model, native.load(cache_root() / "native")) == len(
            [
                m
                for _, m in model.named_modules()
                if isinstance(m, nn.QuantizedLinear | nn.QuantizedEmbedding)
            ]
        )
        assert wrapped(model) and weight_bytes(model) == held
        np.testing.assert_allclose(np.array(model(tokens)), want, atol=1e-4, rtol=1e-4)
    finally:
        detach(model)
