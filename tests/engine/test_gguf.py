"""GGUF files through the loader: tiny files written with llama.cpp's own ``gguf`` writer.

The reference is mlx-lm's own model class holding the weights the file decodes to (dequantized
by the ``gguf`` package, in Hugging Face row order), never our reader.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader

from qfserve.engine.models.gguf import GGUFError
from qfserve.engine.models.gguf.convert import cache_root, converted_folder
from qfserve.engine.models.gguf.reader import open_gguf
from tests.gguf_files import write_other_architecture, write_tiny_gguf, write_with_q8_1
from tests.tiny import _CORPUS, SPECIAL_TOKENS, TINY_CONFIG, _train_tokenizer

TOKENS = [3, 17, 99, 250, 4, 8, 15, 16, 23, 42, 108, 7, 1, 300, 64, 5, 9, 77, 31, 200, 12, 2, 6, 11]


# qfserve's own cache, where the native kernel is built once (each test converts in its own).
NATIVE_CACHE = cache_root()


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QFSERVE_CACHE", str(tmp_path / "cache"))


def load_served(folder):
    """``folder`` loaded as the server loads it, the kernel from qfserve's own cache."""
    from qfserve.engine.models.loading import load_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QFSERVE_CACHE", str(NATIVE_CACHE))
        return load_model(str(folder))


def reference_logits(
    model_type: str, weights: dict[str, np.ndarray], vocab_size: int, **config
) -> np.ndarray:
    import importlib

    arch = importlib.import_module(f"mlx_lm.models.{model_type}")
    args = arch.ModelArgs.from_dict(
        {**TINY_CONFIG, "model_type": model_type, "vocab_size": vocab_size, **config}
    )
    model = arch.Model(args)
    model.load_weights([(k, mx.array(v)) for k, v in weights.items()], strict=True)
    return np.array(model(mx.array([TOKENS]))[0])


def served_logits(folder, *, native: bool = False) -> np.ndarray:
    """Logits of ``folder`` loaded by plain ``mlx_lm.load``, or as the server loads it."""
    import mlx_lm

    from qfserve.engine.models.quantized import detach

    if not native:
        model, _ = mlx_lm.load(str(folder))
        return np.array(model(mx.array([TOKENS]))[0])
    loaded = load_served(folder)
    try:
        return np.array(loaded.model(mx.array([TOKENS]))[0])
    finally:
        detach(loaded.model)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_float32_conversion_gives_the_exact_logits_of_the_decoded_weights(tmp_path, arch):
    path = tmp_path / "tiny.gguf"
    decoded = write_tiny_gguf(path, arch=arch)
    folder = converted_folder(path, dequantize=True)
    vocab = decoded["model.embed_tokens.weight"].shape[0]
    ours, ref = served_logits(folder), reference_logits(arch, decoded, vocab)
    # Same float32 weights in the same mlx-lm graph: bit-identical (Q8_0 and F32 tensors).
    np.testing.assert_array_equal(ours, ref)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_quantized_variant_keeps_q8_0_and_matches_closely(tmp_path):
    path = tmp_path / "tiny.gguf"
    decoded = write_tiny_gguf(path)
    folder = converted_folder(path, dequantize=False)
    names = mx.load(str(folder / "model.safetensors"))
    assert "model.layers.0.self_attn.q_proj.scales" in names  # stayed quantized
    assert "model.layers.0.self_attn.k_proj.scales" not in names  # was F32
    vocab = decoded["model.embed_tokens.weight"].shape[0]
    ref = reference_logits("llama", decoded, vocab)
    # Served (qfserve's kernel, float32 sums): another order of sums than dequantize-then-matmul.
    ours = served_logits(folder, native=True)
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=0)
    # Plain mlx_lm.load reads it too; MLX's own CPU product with float16 scales rounds in float16.
    plain = served_logits(folder)
    np.testing.assert_allclose(plain, ref, atol=2e-2, rtol=0)
    assert (ours.argmax(-1) == ref.argmax(-1)).all() and (plain.argmax(-1) == ref.argmax(-1)).all()


def test_folder_is_plain_mlx_lm_with_tokenizer_and_template(tmp_path):
    import mlx_lm

    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    folder = converted_folder(path, name="tiny-chat", model_id="test/tiny-gguf")
    config = json.loads((folder / "config.json").read_text())
    assert config["_name_or_path"] == "test/tiny-gguf"
    assert json.loads((folder / "qfserve.json").read_text())["served_name"] == "tiny-chat"
    _, tokenizer = mlx_lm.load(str(folder))
    trained = _train_tokenizer(TINY_CONFIG["vocab_size"])
    text = _CORPUS[:500]
    # add_bos_token is set in the file: BOS first, then exactly the original BPE's ids.
    assert tokenizer.encode(text) == [trained.token_to_id("<|bos|>"), *trained.encode(text).ids]
    assert tokenizer.decode(trained.encode(text).ids) == text
    for special in SPECIAL_TOKENS:
        assert tokenizer.convert_tokens_to_ids(special) == trained.token_to_id(special)
    assert trained.token_to_id("<|end|>") in tokenizer.eos_token_ids
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert rendered == "<|user|>hi<|end|><|assistant|>"


def test_conversion_runs_once_and_again_when_the_file_changes(tmp_path):
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    first = converted_folder(path, dequantize=True)
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert converted_folder(path, dequantize=True) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    write_tiny_gguf(path, seed=1)
    second = converted_folder(path, dequantize=True)
    assert second != first and second.parent == first.parent
    assert not list(first.parent.glob(".converting-*"))


def test_truncated_file_is_refused_naming_it(tmp_path):
    path = tmp_path / "cut.gguf"
    write_tiny_gguf(path)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(GGUFError, match="cut.gguf") as info:
        open_gguf(path)
    assert "truncated" in info.value.reason or "not a readable" in info.value.reason
    path.write_bytes(b"GGUF\x03\x00")
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        open_gguf(path)


def test_unsupported_architecture_is_refused(tmp_path):
    path = write_other_architecture(tmp_path / "falcon.gguf", "falcon")
    with pytest.raises(GGUFError, match=r"falcon.gguf: unsupported architecture 'falcon'"):
        open_gguf(path)


def test_unsupported_tensor_type_is_refused(tmp_path):
    path = write_with_q8_1(tmp_path / "q8_1.gguf")
    with pytest.raises(
        GGUFError, match=r"q8_1.gguf: unsupported tensor type Q8_1 \(tensor blk.0.attn_k.weight\)"
    ):
        open_gguf(path)


@pytest.mark.parametrize(
    ("tokenizer_model", "pre", "message"),
    [
        ("llama", "default", "a SentencePiece vocabulary needs .* scores"),  # none written
        ("bert", "default", "unsupported tokenizer model 'bert'"),
        ("gpt2", "deepseek-coder", "unsupported pre-tokenizer 'deepseek-coder'"),
    ],
)
def test_unsupported_tokenizers_are_refused(tmp_path, tokenizer_model, pre, message):
    path = tmp_path / "tok.gguf"
    write_tiny_gguf(path, tokenizer_model=tokenizer_model, pre=pre)
    with pytest.raises(GGUFError, match=message):
        converted_folder(path)
    assert not list((tmp_path / "cache" / "models").rglob("model.safetensors"))


@pytest.mark.parametrize(
    ("qtype", "bits"),
    [
        (GGMLQuantizationType.Q5_0, 5),
        (GGMLQuantizationType.Q5_1, 5),
        (GGMLQuantizationType.Q4_0, 4),
    ],
)
def test_every_quantized_type_is_kept_as_codes_at_its_bits(tmp_path, qtype, bits):
    """The folder holds codes of the file's bits (per layer in mlx-lm's quantization config),
    no float32 copy; they dequantize to exactly the gguf package's values, and the served
    logits are the decoded weights' up to the quantized product's order of sums."""
    path = tmp_path / "q.gguf"
    decoded = write_tiny_gguf(path, quantized=("ffn_down", "attn_q"), qtype=qtype)
    folder = converted_folder(path)
    config = json.loads((folder / "config.json").read_text())
    weights = mx.load(str(folder / "model.safetensors"))
    stem = "model.layers.0.self_attn.q_proj"
    assert weights[f"{stem}.weight"].dtype == mx.uint32
    bits_of = config["quantization"].get(stem, config["quantization"])["bits"]
    assert bits_of == bits
    # float16 scales, exact for these types: widened, MLX's dequantize gives the file's values.
    assert weights[f"{stem}.scales"].dtype == mx.float16
    deq = mx.dequantize(weights[f"{stem}.weight"], weights[f"{stem}.scales"].astype(mx.float32),
                        weights[f"{stem}.biases"].astype(mx.float32), group_size=32, bits=bits)  # fmt: skip
    np.testing.assert_array_equal(np.array(deq), decoded[f"{stem}.weight"])
    vocab = decoded["model.embed_tokens.weight"].shape[0]
    ours, ref = served_logits(folder, native=True), reference_logits("llama", decoded, vocab)
    np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=0)


@pytest.mark.parametrize(("qtype", "bits"), [("Q4_K", 4), ("Q5_K", 5), ("Q6_K", 8)])
def test_k_quants_are_served_on_their_codes(tmp_path, qtype, bits):
    """A file with a K-quant tensor (random blocks of the type), loaded as the server loads
    it: the kernel reads the layer at the codes' bits, and the logits are those of the weights
    the folder stores (the gguf package's values up to the float16 scales' rounding, and for
    Q6_K the 8-bit requantization: both measured in test_gguf_codes)."""
    from qfserve.engine.models.gguf.codes import dequantize, requantize, stored, tensor_codes
    from qfserve.engine.models.quantized import detach

    path = tmp_path / "k.gguf"
    decoded = write_tiny_gguf(path, quantized=("ffn_down",), qtype=GGMLQuantizationType[qtype])
    loaded = load_served(converted_folder(path))
    try:
        down = loaded.model.model.layers[0].mlp.down_proj
        assert isinstance(down, nn.QuantizedLinear) and down.bits == bits
        vocab = decoded["model.embed_tokens.weight"].shape[0]
        for name in [n for n in decoded if "down_proj" in n]:
            codes = requantize(decoded[name])
            if qtype != "Q6_K":  # the file's own codes: read them back from the file
                tensor = next(t for t in GGUFReader(path).tensors
                              if t.name == f"blk.{name.split('.')[2]}.ffn_down.weight")  # fmt: skip
                codes = tensor_codes(np.asarray(tensor.data), qtype, decoded[name].shape)
            scales, biases = stored(codes)
            codes = type(codes)(codes.q, scales.astype(np.float32), biases.astype(np.float32),
                                codes.bits)  # fmt: skip
            decoded[name] = dequantize(codes)
        ours = np.array(loaded.model(mx.array([TOKENS]))[0])
        ref = reference_logits("llama", decoded, vocab)
        np.testing.assert_allclose(ours, ref, atol=2e-4, rtol=0)
        assert (ours.argmax(-1) == ref.argmax(-1)).all()
    finally:
        detach(loaded.model)


def test_llama3_rope_scaling_is_recovered_from_the_rope_freqs_tensor(tmp_path):
    path = tmp_path / "llama31.gguf"
    decoded = write_tiny_gguf(path, llama3_factor=32.0, rope_theta=500000.0)
    folder = converted_folder(path, dequantize=True)
    scaling = json.loads((folder / "config.json").read_text())["rope_scaling"]
    assert scaling == {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    vocab = decoded["model.embed_tokens.weight"].shape[0]
    reference = reference_logits("llama", decoded, vocab, rope_theta=500000.0, rope_scaling=scaling)
    np.testing.assert_array_equal(served_logits(folder), reference)
    unscaled = reference_logits("llama", decoded, vocab, rope_theta=500000.0)
    assert not np.allclose(reference, unscaled)  # the scaling matters at these positions


def test_one_part_of_a_split_file_is_refused(tmp_path):
    path = tmp_path / "model-00001-of-00002.gguf"
    write_tiny_gguf(path, extra_kv={"split.count": 2})
    with pytest.raises(
        GGUFError, match=r"split GGUF \(2 files\); merge them first .*llama-gguf-split --merge"
    ):
        open_gguf(path)
