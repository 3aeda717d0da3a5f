"""DeepSeek-V3 MoE decoder layers: multi-latent attention and a capacity-bounded MoE.

Simplifications against the released model, none of which changes what the layer
saves for backward in a meaningful way: no YaRN RoPE scaling (so the softmax scale is
plain 1/sqrt(qk_head_dim)), RoPE in the rotate-half rather than interleaved layout,
and plain top-k routing without the expert-group limit or the load-balancing bias.
Routed experts run as a grouped GEMM over a fixed per-expert capacity
(GShard/Switch style, overflow dropped) so every shape is static.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from . import _common
from ._common import INIT_STD, SwiGLU, apply_rope


@dataclass(frozen=True)
class DeepSeekConfig:
    hidden: int
    heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    moe_intermediate_size: int
    n_routed_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    layers: int
    batch: int
    seq: int
    capacity_factor: float = 1.25
    routed_scaling_factor: float = 2.5
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    vocab_size: int | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


SIZES: dict[str, DeepSeekConfig] = {
    "tiny": DeepSeekConfig(
        hidden=256, heads=4, q_lora_rank=128, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        moe_intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, layers=2, batch=2, seq=32,
        # Tight enough that the tiny model really drops overflowing assignments.
        capacity_factor=1.0,
    ),
    # The tiny layer as a language model (tests/test_fp8_training.py), 256 tokens. At
    # batch 2 x seq 128 each expert has 128 slots, which every recipe's FP8 GEMMs take
    # (blockwise needs 128).
    "tiny_lm": DeepSeekConfig(
        hidden=256, heads=4, q_lora_rank=128, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        moe_intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, layers=2, batch=2, seq=128, capacity_factor=1.0, vocab_size=256,
    ),
    # One MoE layer of DeepSeek-V3 (671B).
    "real": DeepSeekConfig(
        hidden=7168, heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
        n_shared_experts=1, layers=1, batch=1, seq=4096,
    ),
}  # fmt: skip


class Attention(nn.Module):
    """Multi-latent attention: queries and keys/values pass through low-rank latents."""

    def __init__(self, config: DeepSeekConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        self.q_a_proj = nn.Linear(c.hidden, c.q_lora_rank, bias=False)
        self.q_a_layernorm = nn.RMSNorm(c.q_lora_rank, eps=c.norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, c.heads * c.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            c.hidden, c.kv_lora_rank + c.qk_rope_head_dim, bias=False
        )
        self.kv_a_layernorm = nn.RMSNorm(c.kv_lora_rank, eps=c.norm_eps)
        self.kv_b_proj = nn.Linear(
            c.kv_lora_rank, c.heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(c.heads * c.v_head_dim, c.hidden, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        c = self.config
        batch, seq, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(batch, seq, c.heads, c.qk_head_dim).transpose(1, 2)
        q_nope, q_rope = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)

        latent, k_rope = self.kv_a_proj_with_mqa(x).split(
            [c.kv_lora_rank, c.qk_rope_head_dim], dim=-1
        )
        kv = self.kv_b_proj(self.kv_a_layernorm(latent))
        kv = kv.view(batch, seq, c.heads, c.qk_nope_head_dim + c.v_head_dim).transpose(1, 2)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        # The rope part of the key is a single head shared by all query heads (MQA).
        k_rope = apply_rope(k_rope.unsqueeze(1), cos, sin).expand(-1, c.heads, -1, -1)

        q = torch.cat((q_nope, apply_rope(q_rope, cos, sin)), dim=-1)
        k = torch.cat((k_nope, k_rope), dim=-1)
        # Fused attention kernels want one head size for q, k and v: pad v to the q/k size and
        # drop the padding after, as DeepSeek-V3 training stacks do for flash attention.
        pad = c.qk_head_dim - c.v_head_dim
        out = F.scaled_dot_product_attention(
            q, k, F.pad(v, (0, pad)), is_causal=True, scale=1.0 / math.sqrt(c.qk_head_dim)
        )[..., : c.v_head_dim]
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class Experts(nn.Module):
    """Routed SwiGLU experts as 3-D weights, applied to an (E, C, hidden) buffer by bmm."""

    def __init__(self, config: DeepSeekConfig) -> None:
        super().__init__()
        e, h, i = config.n_routed_experts, config.hidden, config.moe_intermediate_size
        self.gate_proj = nn.Parameter(torch.empty(e, h, i))
        self.up_proj = nn.Parameter(torch.empty(e, h, i))
        self.down_proj = nn.Parameter(torch.empty(e, i, h))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for weight in (self.gate_proj, self.up_proj, self.down_proj):
            nn.init.normal_(weight, std=INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.silu(torch.bmm(x, self.gate_proj)) * torch.bmm(x, self.up_proj)
        return torch.bmm(hidden, self.down_proj)


class MoE(nn.Module):
    def __init__(self, config: DeepSeekConfig) -> None:
        super().__init__()
        self.config = config
        self.gate = nn.Linear(config.hidden, config.n_routed_experts, bias=False)
        self.experts = Experts(config)
        self.shared_experts = SwiGLU(
            config.hidden, config.n_shared_experts * config.moe_intermediate_size
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        n_experts, top_k = c.n_routed_experts, c.num_experts_per_tok
        tokens = x.reshape(-1, x.shape[-1])
        n_tokens = tokens.shape[0]
        capacity = math.ceil(n_tokens * top_k / n_experts * c.capacity_factor)
        n_slots = n_experts * capacity

        scores = self.gate(tokens).float().sigmoid()
        weights, expert = scores.topk(top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True) * c.routed_scaling_factor

        # Flatten assignments choice-major so every token's first choice claims
        # capacity before any second choice (GShard priority).
        expert = expert.t().reshape(-1)
        weights = weights.t().reshape(-1)
        token = torch.arange(n_tokens, device=x.device).repeat(top_k)
        one_hot = expert.unsqueeze(1) == torch.arange(n_experts, device=x.device)
        position = one_hot.cumsum(0).gather(1, expert.unsqueeze(1)).squeeze(1) - 1
        kept = position < capacity
        # Overflowing assignments write to one extra slot that is then discarded.
        slot = torch.where(kept, expert * capacity + position, n_slots)

        # Unclaimed slots keep token 0: wasted but harmless work, since no token reads
        # their output back and so no gradient flows through them.
        slot_token = torch.zeros(n_slots + 1, dtype=torch.long, device=x.device)
        slot_token = slot_token.scatter(0, slot, token)[:n_slots]
        dispatched = tokens.index_select(0, slot_token).view(n_experts, capacity, -1)
        expert_out = self.experts(dispatched).view(n_slots, -1)

        # Dropped assignments read an arbitrary valid slot with weight zero.
        combine = (weights * kept).to(x.dtype).unsqueeze(1)
        routed = expert_out.index_select(0, slot.clamp(max=n_slots - 1)) * combine
        routed = routed.view(top_k, n_tokens, -1).sum(0)
        return (routed + self.shared_experts(tokens)).view_as(x)


class Block(nn.Module):
    def __init__(self, config: DeepSeekConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.input_layernorm = nn.RMSNorm(config.hidden, eps=config.norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = nn.RMSNorm(config.hidden, eps=config.norm_eps)
        self.mlp = MoE(config)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Model(_common.RopeDecoder):
    """Stack of DeepSeek MoE blocks; with ``config.vocab_size`` set it maps token ids to logits."""

    def __init__(self, config: DeepSeekConfig) -> None:
        super().__init__(config, Block, rope_dim=config.qk_rope_head_dim)


build = _common.builder(Model, SIZES)
