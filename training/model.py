"""A Llama decoder in PyTorch whose parameter names and maths match mlx-lm's ``llama``.

The state dict keys are exactly the safetensors names mlx-lm loads (``model.layers.N...``),
RoPE is the rotate-half ("non-traditional") form mlx-lm and HF Llama use, and the output
head is tied to the embedding, so export is a plain dtype/format conversion.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyper-parameters (names follow HF/mlx-lm ``config.json``)."""

    vocab_size: int = 4096
    hidden_size: int = 256
    num_hidden_layers: int = 6
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 640
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                "num_attention_heads must be a multiple of num_key_value_heads, got "
                f"{self.num_attention_heads} and {self.num_key_value_heads}"
            )

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Same order as mx.fast.rms_norm: normalise in float32, then scale.
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return x * self.weight


def rope_tables(
    length: int, head_dim: int, theta: float, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (L, D) for rotate-half RoPE."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=device).float() / head_dim))
    angles = torch.outer(torch.arange(length, device=device).float(), inv_freq)  # (L, D/2)
    angles = torch.cat([angles, angles], dim=-1)  # (L, D)
    return angles.cos(), angles.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x of shape (B, H, L, D): pairs are (i, i + D/2)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.num_attention_heads
        self.n_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        d = cfg.hidden_size
        self.q_proj = nn.Linear(d, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(d, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, d, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, L, _ = x.shape
        queries = self.q_proj(x).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)
        keys = self.k_proj(x).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        values = self.v_proj(x).view(B, L, self.n_kv_heads, self.head_dim).transpose(1, 2)
        # (B, H, L, D) for queries, (B, H_kv, L, D) for keys/values
        queries, keys = apply_rope(queries, cos, sin), apply_rope(keys, cos, sin)
        repeats = self.n_heads // self.n_kv_heads
        keys = keys.repeat_interleave(repeats, dim=1)  # (B, H, L, D)
        values = values.repeat_interleave(repeats, dim=1)
        out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True)
        out = out.transpose(1, 2).reshape(B, L, self.n_heads * self.head_dim)  # (B, L, H*D)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Llama(nn.Module):
    """Causal LM with tied embeddings; ``forward(tokens (B, L)) -> logits (B, L, V)``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.apply(self._init)
        # GPT-2 style: shrink residual-branch outputs with depth.
        for name, p in self.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.num_hidden_layers))

    @staticmethod
    def _init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        L = tokens.shape[1]
        if L > self.cfg.max_position_embeddings:
            raise ValueError(
                f"sequence length must be <= max_position_embeddings "
                f"({self.cfg.max_position_embeddings}), got {L}"
            )
        cos, sin = rope_tables(L, self.cfg.head_dim, self.cfg.rope_theta, tokens.device)
        x = self.model.embed_tokens(tokens)  # (B, L, d)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        return x @ self.model.embed_tokens.weight.T  # (B, L, V)
