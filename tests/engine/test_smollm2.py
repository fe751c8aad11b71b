"""The default model, SmolLM2-135M-Instruct from its GGUF file, against independent references:
a numpy forward pass over the ``gguf`` package's dequantized tensors (llama.cpp's layout and
interleaved RoPE, not our loader), the file's own vocabulary, and a direct jinja render of its
chat template."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from gguf import GGUFReader
from gguf.quants import dequantize

PROMPT_IDS_TEXT = (
    "<|im_start|>user\nWhat is the capital of France? Answer in one sentence.<|im_end|>\n"
)


@pytest.fixture(scope="module")
def reader(smollm2_gguf) -> GGUFReader:
    return GGUFReader(smollm2_gguf)


@pytest.fixture(scope="module")
def served(smollm2_folder):
    """The folder as the server loads it (on the CPU, the native kernel on the codes; plain
    ``mlx_lm.load`` runs MLX's own quantized product, which computes in the float16 of the
    scales)."""
    from qfserve.engine.models.loading import load_model
    from qfserve.engine.models.quantized import detach

    loaded = load_model(str(smollm2_folder))
    yield loaded.model, loaded.tokenizer
    detach(loaded.model)


def _field(reader: GGUFReader, key: str):
    return reader.fields[key].contents()


def numpy_forward(reader: GGUFReader, ids: list[int]) -> np.ndarray:
    """Logits ``(L, vocab)`` in float64 from the file's tensors, as llama.cpp computes them."""
    t = {x.name: x for x in reader.tensors}

    def w(name: str) -> np.ndarray:
        x = t[name]
        data = dequantize(np.asarray(x.data), x.tensor_type).astype(np.float64)
        return data.reshape(tuple(int(d) for d in reversed(x.shape)))

    n_layers = int(_field(reader, "llama.block_count"))
    n_heads = int(_field(reader, "llama.attention.head_count"))
    n_kv = int(_field(reader, "llama.attention.head_count_kv"))
    eps = float(_field(reader, "llama.attention.layer_norm_rms_epsilon"))
    base = float(_field(reader, "llama.rope.freq_base"))

    def norm(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight

    def rope(x):  # (L, H, D): llama.cpp's "normal" RoPE rotates adjacent pairs
        d = x.shape[-1]
        angles = np.arange(x.shape[0])[:, None] * base ** (-np.arange(0, d, 2) / d)
        cos, sin = np.cos(angles)[:, None], np.sin(angles)[:, None]
        out = np.empty_like(x)
        out[..., 0::2] = x[..., 0::2] * cos - x[..., 1::2] * sin
        out[..., 1::2] = x[..., 0::2] * sin + x[..., 1::2] * cos
        return out

    embed = w("token_embd.weight")
    x = embed[ids]  # (L, E)
    L = len(ids)
    mask = np.triu(np.full((L, L), -np.inf), 1)
    for i in range(n_layers):
        h = norm(x, w(f"blk.{i}.attn_norm.weight"))
        q = rope((h @ w(f"blk.{i}.attn_q.weight").T).reshape(L, n_heads, -1))
        k = rope((h @ w(f"blk.{i}.attn_k.weight").T).reshape(L, n_kv, -1))
        v = (h @ w(f"blk.{i}.attn_v.weight").T).reshape(L, n_kv, -1)
        group = n_heads // n_kv
        heads = []
        for head in range(n_heads):
            scores = q[:, head] @ k[:, head // group].T / np.sqrt(q.shape[-1]) + mask
            p = np.exp(scores - scores.max(-1, keepdims=True))
            heads.append((p / p.sum(-1, keepdims=True)) @ v[:, head // group])
        x = x + np.concatenate(heads, -1) @ w(f"blk.{i}.attn_output.weight").T
        h = norm(x, w(f"blk.{i}.ffn_norm.weight"))
        gate = h @ w(f"blk.{i}.ffn_gate.weight").T
        up = h @ w(f"blk.{i}.ffn_up.weight").T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w(f"blk.{i}.ffn_down.weight").T
    head = w("output.weight") if "output.weight" in t else embed
    return norm(x, w("output_norm.weight")) @ head.T


def test_logits_match_a_numpy_forward_pass_of_the_gguf_tensors(reader, served):
    model, tokenizer = served
    ids = tokenizer.encode(PROMPT_IDS_TEXT)
    assert len(ids) >= 16
    reference = numpy_forward(reader, ids)
    ours = np.array(model(mx.array([ids]))[0], dtype=np.float64)
    # float32 model vs float64 reference over 30 layers; logits span about +-33 and the
    # largest difference measured here is 6e-5.
    np.testing.assert_allclose(ours, reference, atol=5e-4, rtol=0)
    assert (ours.argmax(-1) == reference.argmax(-1)).all()


def test_tokenizer_round_trips_standard_library_sources(served):
    _, tokenizer = served
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:12]
    for path in files:
        text = path.read_text(encoding="utf-8")[:20_000]
        assert tokenizer.decode(tokenizer.encode(text)) == text, path.name


def test_specials_and_strings_map_to_the_files_vocabulary(reader, served):
    _, tokenizer = served
    tokens = [str(t) for t in _field(reader, "tokenizer.ggml.tokens")]
    types = list(_field(reader, "tokenizer.ggml.token_type"))
    for special in ("<|endoftext|>", "<|im_start|>", "<|im_end|>"):
        assert types[tokens.index(special)] == 3  # control token in the file
        assert tokenizer.encode(special) == [tokens.index(special)]
    # Byte-level BPE spells a leading space as "Ġ"; the smollm pre-tokenizer splits digits.
    assert tokenizer.encode("Hello world") == [tokens.index("Hello"), tokens.index("Ġworld")]
    assert tokenizer.encode("2024") == [tokens.index(d) for d in "2024"]
    assert tokenizer.encode("<|im_start|>user") == [
        tokens.index("<|im_start|>"),
        tokens.index("user"),
    ]
    eos = int(_field(reader, "tokenizer.ggml.eos_token_id"))
    assert tokens[eos] == "<|im_end|>" and eos in tokenizer.eos_token_ids


def test_chat_template_renders_as_jinja_renders_the_files_template(reader, served):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    _, tokenizer = served
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another?"},
    ]
    template = str(_field(reader, "tokenizer.chat_template"))
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    for msgs in (messages, messages[1:2]):
        expected = env.from_string(template).render(messages=msgs, add_generation_prompt=True)
        rendered = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        assert rendered == expected
    assert expected.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
