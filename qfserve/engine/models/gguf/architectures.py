"""The GGUF architectures qfserve reads: for each, the mlx-lm model it becomes, the names of
its tensors there, and its ``config.json`` from the file's ``<arch>.*`` metadata.

What a file does not say, llama.cpp's loader assumes, and so does this table: Gemma 3's local
layers' RoPE base (10,000) and its pattern of five sliding-window layers to one global layer;
its attention scale (``1/sqrt(head_dim)``, except the 27B's ``1/sqrt(hidden/heads)``). Where
llama.cpp's converter changed a tensor, the change is undone on load (:data:`Architecture`'s
``permuted`` and ``norm_shift``); fused tensors stay fused where mlx-lm's model keeps them so
(Phi-3's ``qkv_proj`` and ``gate_up_proj``: the file's codes are used as they are).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from qfserve.engine.models.gguf.reader import GGUFFile

Getter = Callable[..., Any]

_GLOBAL_NAMES = MappingProxyType(
    {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
)
_LLAMA_LAYER = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_QK_NORMS = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}


@dataclass(frozen=True)
class Architecture:
    """How one GGUF architecture maps to mlx-lm.

    Attributes:
        model_type: mlx-lm's ``model_type`` (its module under ``mlx_lm.models``).
        hf_class: The ``architectures`` entry of the config.
        layer_names: GGUF per-layer stem -> mlx-lm path inside ``model.layers.<i>``.
        permuted: llama.cpp's converter permuted Q/K rows for interleaved-pair RoPE.
        norm_shift: Stored norm weights are mlx-lm's plus this (Gemma's converter adds 1).
        extra: More config entries from the metadata (``get(key, default)`` reads
            ``<arch>.<key>``).
    """

    model_type: str
    hf_class: str
    layer_names: Mapping[str, str]
    permuted: bool = False
    norm_shift: float = 0.0
    extra: Callable[[GGUFFile, Getter, dict[str, Any]], dict[str, Any]] = field(
        default=lambda file, get, config: {}
    )


def _llama_extra(file: GGUFFile, get: Getter, config: dict[str, Any]) -> dict[str, Any]:
    return {
        "attention_bias": "blk.0.attn_q.bias" in file.tensor_types,
        "mlp_bias": "blk.0.ffn_up.bias" in file.tensor_types,
    }


# llama.cpp's Gemma 3 constants (llama-model.cpp): not in the file.
GEMMA3_LOCAL_ROPE_BASE = 10_000.0
GEMMA3_SLIDING_PATTERN = 6
_GEMMA3_27B_LAYERS = 62  # the one size whose attention scale is 1/sqrt(hidden / heads)


def _gemma3_extra(file: GGUFFile, get: Getter, config: dict[str, Any]) -> dict[str, Any]:
    from qfserve.engine.models.gguf.reader import GGUFError

    pattern = get("attention.sliding_window_pattern", GEMMA3_SLIDING_PATTERN)
    if not isinstance(pattern, int | np.integer) or int(pattern) < 1:
        raise GGUFError(
            file.path,
            f"unsupported gemma3.attention.sliding_window_pattern {pattern!r} (an integer period)",
        )
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    scalar = hidden // heads if config["num_hidden_layers"] == _GEMMA3_27B_LAYERS else None
    return {
        "sliding_window": int(get("attention.sliding_window")),
        "sliding_window_pattern": int(pattern),
        "rope_local_base_freq": GEMMA3_LOCAL_ROPE_BASE,
        "query_pre_attn_scalar": scalar or config["head_dim"],
    }


def _phi3_extra(file: GGUFFile, get: Getter, config: dict[str, Any]) -> dict[str, Any]:
    from qfserve.engine.models.gguf.reader import GGUFError

    if "rope_factors_long.weight" in file.tensor_types:
        # mlx-lm's SuScaledRoPE always applies the long factors; llama.cpp switches to the
        # short ones below the original context: the two would not compute the same model.
        raise GGUFError(file.path, "Phi-3 LongRoPE (128k-context) files are not supported")
    rotary = int(get("rope.dimension_count", config["head_dim"]))
    return {
        "partial_rotary_factor": rotary / config["head_dim"],
        "original_max_position_embeddings": config["max_position_embeddings"],
    }


ARCHITECTURES: Mapping[str, Architecture] = MappingProxyType(
    {
        "llama": Architecture("llama", "LlamaForCausalLM", _LLAMA_LAYER, True, extra=_llama_extra),
        "qwen2": Architecture("qwen2", "Qwen2ForCausalLM", _LLAMA_LAYER),
        "qwen3": Architecture("qwen3", "Qwen3ForCausalLM", {**_LLAMA_LAYER, **_QK_NORMS}),
        "gemma3": Architecture(
            "gemma3_text",
            "Gemma3ForCausalLM",
            {
                **_LLAMA_LAYER,
                **_QK_NORMS,
                "ffn_norm": "pre_feedforward_layernorm",
                "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm",
            },
            norm_shift=1.0,
            extra=_gemma3_extra,
        ),
        "phi3": Architecture(
            "phi3",
            "Phi3ForCausalLM",
            {
                "attn_norm": "input_layernorm",
                "ffn_norm": "post_attention_layernorm",
                "attn_qkv": "self_attn.qkv_proj",
                "attn_output": "self_attn.o_proj",
                "ffn_up": "mlp.gate_up_proj",  # gate then up, as mlx-lm splits it
                "ffn_down": "mlp.down_proj",
            },
            extra=_phi3_extra,
        ),
    }
)


def mlx_name(arch: Architecture, gguf_name: str, match: Any) -> str | None:
    """The mlx-lm parameter name of a GGUF tensor (``match``: its name split by the reader's
    pattern), or ``None`` for a name outside the architecture's table."""
    layer, base, kind = match.groups()
    if layer is None:
        target = _GLOBAL_NAMES.get(base)
        return None if target is None else f"{target}.{kind}"
    target = arch.layer_names.get(base)
    return None if target is None else f"model.layers.{layer}.{target}.{kind}"


def is_norm(gguf_name: str) -> bool:
    """A norm's weight (what Gemma's converter shifts by +1)."""
    return gguf_name.endswith("norm.weight")
