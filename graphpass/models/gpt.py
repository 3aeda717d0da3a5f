"""GPT-3 decoder layers: pre-LayerNorm, fused-QKV multi-head attention, GELU MLP.

The real size is the GPT-3 175B layer analysed by Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models".
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import _common


@dataclass(frozen=True)
class GPTConfig:
    hidden: int
    heads: int
    ffn: int
    layers: int
    batch: int
    seq: int
    norm_eps: float = 1e-5
    # Applied to attention probabilities, both residual branches and (LM only) embeddings.
    dropout: float = 0.0
    vocab_size: int | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


SIZES: dict[str, GPTConfig] = {
    "tiny": GPTConfig(hidden=256, heads=4, ffn=1024, layers=2, batch=2, seq=32),
    "real": GPTConfig(hidden=12288, heads=96, ffn=49152, layers=1, batch=1, seq=2048),
}


def _dropout(x: torch.Tensor, p: float, training: bool) -> torch.Tensor:
    # Skipping the call keeps p=0 graphs free of dropout/mask nodes.
    return F.dropout(x, p, training=True) if p > 0 and training else x


class Attention(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.heads, self.head_dim, self.dropout = config.heads, config.head_dim, config.dropout
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.proj = nn.Linear(config.hidden, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        qkv = self.qkv(x).view(batch, seq, 3, self.heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        p = self.dropout if self.training else 0.0
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(batch, seq, hidden))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(config.hidden, config.ffn)
        self.fc2 = nn.Linear(config.ffn, config.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.dropout = config.dropout
        self.ln_1 = nn.LayerNorm(config.hidden, eps=config.norm_eps)
        self.attn = Attention(config)
        self.ln_2 = nn.LayerNorm(config.hidden, eps=config.norm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + _dropout(self.attn(self.ln_1(x)), self.dropout, self.training)
        return x + _dropout(self.mlp(self.ln_2(x)), self.dropout, self.training)


class Model(nn.Module):
    """Stack of GPT blocks; with ``config.vocab_size`` set it maps token ids to logits.

    The LM variant adds learned absolute positions (``pos_embeddings``, ``config.seq``
    of them) as GPT does; unlike GPT-3 the output head is not tied to the embeddings.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        lm = config.vocab_size is not None
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden) if lm else None
        self.pos_embeddings = nn.Embedding(config.seq, config.hidden) if lm else None
        self.layers = nn.ModuleList([Block(config, i) for i in range(config.layers)])
        self.norm = nn.LayerNorm(config.hidden, eps=config.norm_eps)
        self.output = nn.Linear(config.hidden, config.vocab_size, bias=False) if lm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None and self.pos_embeddings is not None:
            positions = torch.arange(x.shape[1], device=x.device)
            x = self.tok_embeddings(x) + self.pos_embeddings(positions)
            x = _dropout(x, self.config.dropout, self.training)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        return x if self.output is None else self.output(x)


build = _common.builder(Model, SIZES)
