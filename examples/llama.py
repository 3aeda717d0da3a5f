"""Llama-3 decoder layers: RMSNorm, grouped-query attention with RoPE, SwiGLU MLP."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import _common
from ._common import SwiGLU, apply_rope


@dataclass(frozen=True)
class LlamaConfig:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    layers: int
    batch: int
    seq: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5
    vocab_size: int | None = None


_TINY = LlamaConfig(
    hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512, layers=2, batch=2, seq=32
)

SIZES: dict[str, LlamaConfig] = {
    "tiny": _TINY,
    "tiny_lm": dataclasses.replace(_TINY, vocab_size=256),
    # Llama-3-8B.
    "real": LlamaConfig(
        hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, layers=1, batch=1, seq=8192
    ),
}


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.heads, config.kv_heads, config.head_dim
        self.q_proj = nn.Linear(config.hidden, config.heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden, config.kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden, config.kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.heads * config.head_dim, config.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch, seq, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    def __init__(self, config: LlamaConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.input_layernorm = nn.RMSNorm(config.hidden, eps=config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden, eps=config.norm_eps)
        self.mlp = SwiGLU(config.hidden, config.ffn)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(_common.RopeDecoder):
    """Stack of Llama blocks; with ``config.vocab_size`` set it maps token ids to logits."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__(config, Block, rope_dim=config.head_dim)


build = _common.builder(Model, SIZES)
