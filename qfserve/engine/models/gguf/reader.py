"""Read a GGUF file into an mlx-lm config and weights: a table of names and one conversion.

Metadata, tensor types and tensor bytes come from llama.cpp's ``gguf`` package
(``GGUFReader``), which also validates the file's structure. Quantized matrices become MLX
affine codes (:mod:`qfserve.engine.models.gguf.codes`: the file's own codes where the layouts
map, a measured 8-bit requantization where they do not), so the folder holds the weights at
about the file's size; float tensors keep their type. Types the ``gguf`` package cannot read
are refused.

Two details of llama.cpp's conversion are undone here (:mod:`.architectures` says which files
have them): Q/K rows of ``llama`` files are permuted for llama.cpp's interleaved-pair RoPE;
they are put back in the Hugging Face order (codes, scales and biases alike: the permutation
moves whole rows) so the folder is a plain Llama checkpoint (mlx-lm's default,
non-traditional RoPE). Gemma's norm weights are stored as ``1 + w``; mlx-lm's Gemma adds the
1 itself.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qfserve.engine.models.gguf import architectures
from qfserve.engine.models.gguf.architectures import ARCHITECTURES, Architecture
from qfserve.engine.models.gguf.codes import FLOAT_TYPES, pack, stored, tensor_codes

# ``tokenizer.ggml.*`` arrays kept apart from the metadata (large).
VOCAB_ARRAYS = ("tokens", "token_type", "merges", "scores")
# The output projection: its own tensor, or the embedding where the two are tied.
OUTPUT_TENSORS = frozenset({"output.weight", "token_embd.weight"})
_TENSOR_NAME = re.compile(r"^(?:blk\.(\d+)\.)?([a-z_]+)\.(weight|bias)$")


class GGUFError(ValueError):
    """A GGUF file qfserve cannot serve; the message names the file and the reason."""

    def __init__(self, path: str | Path, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = str(path)
        self.reason = reason


@dataclass(frozen=True)
class GGUFFile:
    """What a GGUF file says about itself, checked for what qfserve can load.

    Attributes:
        path: The file.
        metadata: Every key-value field except the (large) vocabulary arrays, as Python values.
        vocab: ``tokenizer.ggml.*`` arrays: ``tokens``, ``token_type``, ``merges``, ``scores``
            (each may be absent).
        tensor_types: GGUF name -> GGML type name, e.g. ``"Q4_1"``.
        config: The mlx-lm ``config.json`` the file describes.
    """

    path: Path
    metadata: dict[str, Any]
    vocab: dict[str, list[Any]]
    tensor_types: dict[str, str]
    config: dict[str, Any]

    @property
    def architecture(self) -> str:
        return str(self.metadata["general.architecture"])

    @property
    def arch(self) -> Architecture:
        return ARCHITECTURES[self.architecture]


def open_gguf(path: str | Path) -> GGUFFile:
    """Read and check a GGUF file's metadata and tensor table (no tensor data is read).

    Raises:
        GGUFError: not a GGUF file, truncated, an architecture other than those in
            :data:`ARCHITECTURES`, a tensor type nothing here reads, or a tensor with no
            mlx-lm counterpart.
    """
    from gguf import GGUFReader

    path = Path(path)
    try:
        reader = GGUFReader(path)
    except Exception as exc:  # the reader raises bare ValueErrors, struct and numpy errors
        raise GGUFError(
            path,
            f"not a readable GGUF file: truncated or corrupt (file is {path.stat().st_size} "
            f"bytes; {type(exc).__name__}: {exc})",
        ) from exc
    metadata: dict[str, Any] = {}
    vocab: dict[str, list[Any]] = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        value = field.contents()
        if key.startswith("tokenizer.ggml.") and key.rsplit(".", 1)[1] in VOCAB_ARRAYS:
            vocab[key.rsplit(".", 1)[1]] = list(value)
        else:
            metadata[key] = value
    size = path.stat().st_size
    tensor_types: dict[str, str] = {}
    for tensor in reader.tensors:
        end = int(tensor.data_offset) + int(tensor.n_bytes)
        if end > size:
            raise GGUFError(
                path, f"truncated: tensor {tensor.name} ends at byte {end}, file has {size}"
            )
        tensor_types[tensor.name] = tensor.tensor_type.name
    if int(metadata.get("split.count", 1)) > 1:
        raise GGUFError(
            path,
            f"one part of a split GGUF ({metadata['split.count']} files); merge them first with "
            "llama.cpp's `llama-gguf-split --merge`",
        )
    file = GGUFFile(path, metadata, vocab, tensor_types, config={})
    config = _config(file)
    _check_tensors(file, config)
    return GGUFFile(path, metadata, vocab, tensor_types, config)


def _config(file: GGUFFile) -> dict[str, Any]:
    """The mlx-lm config of a supported architecture, from ``<arch>.*`` metadata."""
    meta, path = file.metadata, file.path
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            path,
            f"unsupported architecture {arch!r}; qfserve reads GGUF architectures "
            f"{sorted(ARCHITECTURES)}",
        )

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"{arch}.{key}", default)
        if value is None:
            raise GGUFError(path, f"metadata key {arch}.{key} is missing")
        return value

    if get("expert_count", 0):
        raise GGUFError(path, "mixture-of-experts GGUF files are not supported")
    n_heads = int(get("attention.head_count"))
    hidden = int(get("embedding_length"))
    head_dim = int(get("attention.key_length", hidden // n_heads))
    spec = ARCHITECTURES[str(arch)]
    if spec.model_type != "phi3" and int(get("rope.dimension_count", head_dim)) != head_dim:
        raise GGUFError(path, "partial rotary embeddings (rope.dimension_count < head size)")
    n_vocab = len(file.vocab.get("tokens", ())) or int(get("vocab_size"))
    config: dict[str, Any] = {
        "model_type": spec.model_type,
        "architectures": [spec.hf_class],
        "hidden_size": hidden,
        "num_hidden_layers": int(get("block_count")),
        "intermediate_size": int(get("feed_forward_length")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(get("attention.head_count_kv", n_heads)),
        "head_dim": head_dim,
        "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon")),
        "vocab_size": n_vocab,
        "max_position_embeddings": int(get("context_length")),
        "rope_theta": float(get("rope.freq_base", 10000.0)),
        "tie_word_embeddings": "output.weight" not in file.tensor_types,
    }
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise GGUFError(path, f"unsupported RoPE scaling {scaling!r} (linear is supported)")
        config["rope_scaling"] = {"type": "linear", "factor": float(get("rope.scaling.factor"))}
    if "rope_freqs.weight" in file.tensor_types:
        config["rope_scaling"] = _llama3_rope_scaling(file, head_dim, config["rope_theta"])
    config.update(spec.extra(file, get, config))
    _check_config(path, config)
    return config


# Bounds no released model comes near, so a corrupt count is refused here rather than
# allocated, divided by or overflowed later: what the largest GGUF files hold is a few times
# below each.
_LIMITS = {
    "hidden_size": 1 << 17,
    "num_hidden_layers": 1 << 12,
    "intermediate_size": 1 << 20,
    "num_attention_heads": 1 << 12,
    "num_key_value_heads": 1 << 12,
    "head_dim": 1 << 12,
    "vocab_size": 1 << 22,
    "max_position_embeddings": 1 << 26,
}


def _check_config(path: Path, config: dict[str, Any]) -> None:
    """Every size positive and within :data:`_LIMITS`, heads dividing evenly, and the norm's
    epsilon and RoPE's base finite and positive."""
    for key, limit in _LIMITS.items():
        value = config[key]
        if not 0 < value <= limit:
            raise GGUFError(path, f"{key} is {value}: outside 1 .. {limit}")
    if config["num_attention_heads"] % config["num_key_value_heads"]:
        raise GGUFError(
            path,
            f"{config['num_attention_heads']} attention heads do not share "
            f"{config['num_key_value_heads']} key/value heads evenly",
        )
    for key in ("rms_norm_eps", "rope_theta"):
        value = config[key]
        if not (math.isfinite(value) and value > 0):
            raise GGUFError(path, f"{key} is {value}: it must be finite and positive")


# Llama 3.1 / 3.2 RoPE scaling as their config.json states it; GGUF keeps only the per-pair
# frequency factors it implies (a ``rope_freqs`` tensor), so the config is recovered by
# trying the factors those releases use and checking that one reproduces the tensor.
_LLAMA3_FACTORS = (8.0, 32.0, 16.0, 4.0, 2.0)
_LLAMA3_SCALING = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama3_freq_factors(factor: float, head_dim: int, base: float) -> np.ndarray:
    """The per-pair factors ``rope_freqs`` holds for Llama 3 scaling with ``factor``."""
    low, high = _LLAMA3_SCALING["low_freq_factor"], _LLAMA3_SCALING["high_freq_factor"]
    old = _LLAMA3_SCALING["original_max_position_embeddings"]
    freqs = 1.0 / base ** (np.arange(0, head_dim, 2) / head_dim)
    wavelen = 2 * np.pi / freqs
    smooth = (old / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old / high, 1.0, np.where(wavelen > old / low, factor, mid))


def _llama3_rope_scaling(file: GGUFFile, head_dim: int, base: float) -> dict[str, Any]:
    from gguf import GGUFReader

    (tensor,) = [t for t in GGUFReader(file.path).tensors if t.name == "rope_freqs.weight"]
    stored = np.asarray(tensor.data, dtype=np.float64).reshape(-1)
    for factor in _LLAMA3_FACTORS:
        expected = llama3_freq_factors(factor, head_dim, base)
        if expected.shape == stored.shape and np.allclose(stored, expected, rtol=1e-4):
            return {"rope_type": "llama3", "factor": factor, **_LLAMA3_SCALING}
    raise GGUFError(
        file.path,
        "unsupported RoPE scaling: its rope_freqs tensor matches no Llama 3 scaling factor "
        f"in {list(_LLAMA3_FACTORS)}",
    )


def source_fingerprint(file: GGUFFile) -> str:
    """A digest of the file's first and last layers' ``attn_q`` / ``attn_k`` tensors as
    stored (quantized bytes, type, shape): the same for every conversion of the file, and
    unchanged by metadata edits."""
    import hashlib

    from gguf import GGUFReader

    last = file.config["num_hidden_layers"] - 1
    stems = ("attn_q", "attn_k", "attn_qkv")  # Phi-3 keeps the three fused
    wanted = [f"blk.{i}.{n}.weight" for i in (0, last) for n in stems]
    wanted = [name for name in wanted if name in file.tensor_types]
    tensors = {t.name: t for t in GGUFReader(file.path).tensors if t.name in wanted}
    digest = hashlib.sha256()
    for name in wanted:
        tensor = tensors[name]
        digest.update(f"{name}{list(tensor.shape)}{tensor.tensor_type.name}".encode())
        digest.update(np.ascontiguousarray(tensor.data).tobytes())
    return "gguf-" + digest.hexdigest()[:16]


def _check_tensors(file: GGUFFile, config: dict[str, Any]) -> None:
    import gguf.quants

    # The types gguf.quants.dequantize implements (F32 / F16 it views directly).
    readable = FLOAT_TYPES | {t.name for t in getattr(gguf.quants, "_type_traits", {})}
    n_layers = config["num_hidden_layers"]
    for name, type_name in file.tensor_types.items():
        target = mlx_name(name, file.arch)
        if name == "rope_freqs.weight":  # folded into the config (see _llama3_rope_scaling)
            continue
        if target is None or (name.startswith("blk.") and int(name.split(".")[1]) >= n_layers):
            raise GGUFError(file.path, f"tensor {name!r} has no counterpart in mlx-lm's model")
        if type_name not in readable:
            raise GGUFError(
                file.path,
                f"unsupported tensor type {type_name} (tensor {name}); neither MLX nor the "
                "gguf package can dequantize it",
            )


def mlx_name(gguf_name: str, arch: Architecture | None = None) -> str | None:
    """The mlx-lm parameter name of a GGUF tensor, e.g. ``blk.3.attn_q.weight`` ->
    ``model.layers.3.self_attn.q_proj.weight``; ``None`` for a name outside the table of
    ``arch`` (default: Llama's)."""
    match = _TENSOR_NAME.match(gguf_name)
    if match is None:
        return None
    return architectures.mlx_name(arch or ARCHITECTURES["llama"], gguf_name, match)


def load_weights(file: GGUFFile, *, dequantize: bool) -> dict[str, Any]:
    """The file's tensors under mlx-lm names, Q/K rows in Hugging Face order.

    Args:
        file: From :func:`open_gguf`.
        dequantize: Turn every tensor into float32 (a reference; the server keeps codes).
            Otherwise every quantized matrix becomes MLX affine codes (``weight`` uint32,
            ``scales`` and ``biases`` in float16 or float32, group 32; :mod:`.codes` says
            which types keep the file's own codes) and float tensors keep their type.
    Returns:
        ``{name: mx.array}``, ready for ``mx.save_safetensors``.
    """
    import mlx.core as mx
    from gguf import GGUFReader
    from gguf.quants import dequantize as gguf_dequantize

    n_heads = file.config["num_attention_heads"]
    n_kv_heads = file.config["num_key_value_heads"]
    spec = file.arch
    out: dict[str, Any] = {}
    for tensor in GGUFReader(file.path).tensors:
        name, type_name = tensor.name, tensor.tensor_type.name
        if name == "rope_freqs.weight":
            continue
        # GGUF lists dimensions fastest first; numpy wants them slowest first.
        shape = tuple(int(d) for d in reversed(tensor.shape))
        data = np.asarray(tensor.data)
        parts: dict[str, np.ndarray]
        if type_name in FLOAT_TYPES or len(shape) != 2 or dequantize:
            values = gguf_dequantize(data, tensor.tensor_type).reshape(shape)
            values = values.astype(
                np.float16 if type_name == "F16" and not dequantize else np.float32
            )
            parts = {"bias" if name.endswith(".bias") else "weight": values}
        else:
            codes = tensor_codes(data, type_name, shape)
            # The output projection (or the embedding tied to it) is a step's largest product;
            # widening its float16 scales cost SmolLM2 0.6 ms a step, float32 ones 3.5 MB.
            scales, biases = (
                (codes.scales, codes.biases) if name in OUTPUT_TENSORS else stored(codes)
            )
            parts = {"q": codes.q, "scales": scales, "biases": biases}
        if spec.norm_shift and architectures.is_norm(name):  # stored as 1 + w
            parts = {k: v - np.float32(spec.norm_shift) for k, v in parts.items()}
        if spec.permuted and name.startswith("blk.") and name.split(".")[2] in ("attn_q", "attn_k"):
            heads = n_heads if name.split(".")[2] == "attn_q" else n_kv_heads
            parts = {k: unpermute_rows(v, heads) for k, v in parts.items()}
        target = mlx_name(name, spec)
        assert target is not None  # open_gguf refused the others
        stem = target.rsplit(".", 1)[0]
        if "q" in parts:
            bits = codes.bits
            parts = {"weight": pack(np.ascontiguousarray(parts.pop("q")), bits), **parts}
        for suffix, value in parts.items():
            if value.dtype.kind == "f" and not np.isfinite(value).all():
                what = "values" if suffix in ("weight", "bias") else suffix
                raise GGUFError(file.path, f"tensor {name} has NaN or infinite {what}")
            key = target if suffix in ("weight", "bias") else f"{stem}.{suffix}"
            out[key] = mx.array(np.ascontiguousarray(value))
            if type_name == "BF16" and not dequantize:  # numpy has no bfloat16
                out[key] = out[key].astype(mx.bfloat16)
    return out


def unpermute_rows(rows: Any, n_heads: int) -> Any:
    """Undo llama.cpp's Q/K row permutation (interleaved pairs -> rotate-half halves).

    llama.cpp's converter reorders each head's rows ``(2, D/2) -> (D/2, 2)``; this reverses it.
    Works on weights ``(H*D, in)``, their scales and biases, and bias vectors ``(H*D,)``.
    """
    shape = rows.shape
    head_dim = shape[0] // n_heads
    x = rows.reshape(n_heads, head_dim // 2, 2, *shape[1:])  # (H, D/2, 2, ...)
    return x.swapaxes(1, 2).reshape(shape)  # (H, 2, D/2, ...) -> (H*D, ...)
