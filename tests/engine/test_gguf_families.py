"""Gemma 3, Qwen3 and Phi-3 GGUF files: qfserve's conversion against the family's mlx-lm model
built from the same decoded weights, and against llama.cpp on the same file where
llama-cpp-python is installed (``bench/reference/llama_cpp_tools.sh``)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGMLQuantizationType

from qfserve.engine.models.gguf.convert import converted_folder
from qfserve.testing import llama_cpp_python
from tests.engine.test_gguf import TOKENS, load_served
from tests.gguf_families import FAMILIES, reference_model, write_family_gguf

F32_ONLY: tuple[str, ...] = ()


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("QFSERVE_CACHE", str(tmp_path / "cache"))


def served(folder) -> np.ndarray:
    from qfserve.engine.models.quantized import detach

    loaded = load_served(folder)
    try:
        return np.array(loaded.model(mx.array([TOKENS]))[0])
    finally:
        detach(loaded.model)


CASES = [(arch, tied) for arch in FAMILIES for tied in (True, False)]


@pytest.mark.parametrize(("arch", "tied"), CASES)
def test_float32_conversion_is_the_mlx_lm_model_of_the_decoded_weights(tmp_path, arch, tied):
    path = tmp_path / f"{arch}.gguf"
    decoded, _ = write_family_gguf(path, arch, tied=tied)
    folder = converted_folder(path, dequantize=True)
    ref = np.array(reference_model(arch, decoded, tied)(mx.array([TOKENS]))[0])
    np.testing.assert_allclose(served(folder), ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("arch", list(FAMILIES))
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_1", "Q5_0"])  # rows of 64: K-quants need 256
def test_codes_are_served_within_the_kernels_rounding(tmp_path, arch, qtype):
    path = tmp_path / f"{arch}.gguf"
    decoded, _ = write_family_gguf(path, arch, qtype=GGMLQuantizationType[qtype])
    folder = converted_folder(path)
    ref = np.array(reference_model(arch, decoded, True)(mx.array([TOKENS]))[0])
    ours = served(folder)
    np.testing.assert_allclose(ours, ref, atol=5e-4, rtol=0)
    assert (ours.argmax(-1) == ref.argmax(-1)).all()


def test_gemma3_layers_are_sliding_and_global_as_llama_cpp_assumes(tmp_path):
    import json

    path = tmp_path / "gemma3.gguf"
    write_family_gguf(path, "gemma3")
    config = json.loads((converted_folder(path) / "config.json").read_text())
    assert config["model_type"] == "gemma3_text"
    assert (config["sliding_window"], config["sliding_window_pattern"]) == (8, 6)
    assert config["rope_local_base_freq"] == 10_000.0
    assert config["query_pre_attn_scalar"] == config["head_dim"] == 32


def llama_cpp_logits(path, tokens: list[int]) -> np.ndarray:
    llama_cpp = llama_cpp_python()
    if llama_cpp is None:
        pytest.skip("llama-cpp-python is not installed (bench/reference/llama_cpp_tools.sh)")
    model = llama_cpp.Llama(
        str(path), n_ctx=64, logits_all=True, verbose=False, type_k=0, type_v=0
    )  # float32 KV: the comparison is of the model, not of llama.cpp's float16 cache
    model.eval(tokens)
    return np.array(model.scores[: len(tokens)], dtype=np.float32)


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_llama_cpp_computes_the_same_model_on_the_same_file(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    write_family_gguf(path, arch, tied=arch != "phi3", quantized=F32_ONLY)
    ours = served(converted_folder(path))
    theirs = llama_cpp_logits(path, TOKENS)
    # Float32 weights on both sides: only the order of sums differs, and llama.cpp's GELU is
    # a float16 table (Gemma's MLP; 1.5e-3 measured on logits of 2.7).
    np.testing.assert_allclose(ours, theirs, atol=2e-3 if arch == "gemma3" else 1e-5, rtol=0)
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


@pytest.mark.parametrize("arch", list(FAMILIES))
def test_llama_cpp_agrees_on_quantized_files_within_its_activation_rounding(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    write_family_gguf(path, arch)
    ours = served(converted_folder(path))
    theirs = llama_cpp_logits(path, TOKENS)
    # llama.cpp rounds activations to 8 bits before quantized products; qfserve does not.
    spread = float(np.abs(theirs).max())
    np.testing.assert_allclose(ours, theirs, atol=0.03 * spread, rtol=0)
