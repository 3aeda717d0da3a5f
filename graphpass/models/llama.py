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
    # Llama-3-70B.
    "70b": LlamaConfig(
        hidden=8192, heads=64, kv_heads=8, head_dim=128, ffn=28672, layers=1, batch=1, seq=8192
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


def parallelize(block: Block, mesh) -> Block:
    """Tensor + sequence parallelism of one block over a 1-D ``mesh``, as torchtitan applies it:
    the residual stream and the norms sharded on the sequence (``SequenceParallel``), q/k/v and
    gate/up column-parallel after an all-gather of the sequence, o and down row-parallel with a
    reduce-scatter back onto the sequence. The block's inputs are this rank's sequence shard of
    the hidden states (a plain tensor) and the full-sequence RoPE tables."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    tp = mesh.size()
    attn = block.self_attn
    if attn.heads % tp or attn.kv_heads % tp:
        raise ValueError(f"tensor parallel degree {tp} must divide heads ({attn.heads}) and kv "
                         f"heads ({attn.kv_heads})")
    parallelize_module(block, mesh, {
        "input_layernorm": SequenceParallel(),
        "self_attn": PrepareModuleInput(input_layouts=(Shard(1), None, None),
                                        desired_input_layouts=(Replicate(), None, None)),
        "self_attn.q_proj": ColwiseParallel(),
        "self_attn.k_proj": ColwiseParallel(),
        "self_attn.v_proj": ColwiseParallel(),
        "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        "post_attention_layernorm": SequenceParallel(),
        "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
        "mlp.gate_proj": ColwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
    })
    attn.heads //= tp  # each rank runs its heads on local (not DTensor) projections
    attn.kv_heads //= tp
    return block


def build_tp(size: str = "tiny", *, tp: int, seed: int = 0, dtype: torch.dtype | None = None,
             device: str | torch.device | None = None):
    """One block, tensor- and sequence-parallel over ``tp`` ranks of the default process group
    (real or ``graphpass.distributed.fake_process_group``), and this rank's inputs: its sequence
    shard of the hidden states and the RoPE tables. ``layers`` is always 1: planning one rank of
    one layer is what this is for."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    model, (x,) = build(size, layers=1, seed=seed, dtype=dtype, device=device)
    config = model.config
    if config.seq % tp:
        raise ValueError(f"tensor parallel degree {tp} must divide the sequence ({config.seq})")
    mesh_device = "cpu" if x.device.type == "meta" else x.device.type
    mesh = init_device_mesh(mesh_device, (tp,))
    block = parallelize(model.layers[0], mesh)
    cos, sin = _common.rope_cos_sin(config.seq, config.head_dim, config.rope_theta, x.device, x.dtype)
    rank = dist.get_rank()
    local = x.detach().chunk(tp, dim=1)[rank].clone().requires_grad_()
    return block, (local, cos, sin)
