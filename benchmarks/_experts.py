"""The routed experts of a DeepSeek-V3-class MoE layer alone, as token-grouped GEMMs: the
benchmarks' ``experts`` model (``step_time.py --models experts``).

SwiGLU experts over tokens sorted by expert, ``torch._grouped_mm`` with offsets (the form
transformers 5.x and torchtitan write): gate/up (E, 2I, H) and down (E, H, I) weights stored as
nn.Linear's, balanced groups. ``real``: 16 experts, DeepSeek-V3 expert shapes (H 7168, I 2048),
8192 routed tokens (512 per expert); ``real_32k``: the same over 32,768 (2,048 per expert);
``tiny``: 4 experts, H 256, I 128, 512 tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

SIZES = {"tiny": dict(experts=4, hidden=256, inter=128, tokens=512),
         "real": dict(experts=16, hidden=7168, inter=2048, tokens=8192),
         # what one rank of expert parallelism over 16 ranks sees: 2,048 tokens per expert
         "real_32k": dict(experts=16, hidden=7168, inter=2048, tokens=32768)}


class GroupedExperts(nn.Module):
    def __init__(self, experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        gate, up = torch._grouped_mm(x, self.gate_up_proj.transpose(-2, -1), offs=offs).chunk(2, -1)
        return torch._grouped_mm(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs=offs)


class Model(nn.Module):
    """``experts`` under a parent module, so recompute's ``moe_act`` finds ``mlp.experts``."""

    def __init__(self, **size: int) -> None:
        super().__init__()
        self.mlp = nn.Module()
        self.mlp.experts = GroupedExperts(size["experts"], size["hidden"], size["inter"])

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return self.mlp.experts(x, offs)


def build(size: str = "tiny", *, layers: int | None = None, device: str | torch.device | None = None,
          dtype: torch.dtype | None = None, seed: int = 0) -> tuple[Model, tuple[torch.Tensor, ...]]:
    """The experts and their inputs: routed tokens (T, H) and the groups' ends (E,) int32.
    torch's grouped GEMM runs bfloat16 only, so that is the dtype whatever ``dtype`` says."""
    s = SIZES[size]
    g = torch.Generator().manual_seed(seed)
    model = Model(**s)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    model = model.to(device=device, dtype=torch.bfloat16)
    x = torch.randn(s["tokens"], s["hidden"], generator=g).to(device=device, dtype=torch.bfloat16)
    per = s["tokens"] // s["experts"]
    offs = torch.arange(per, s["tokens"] + 1, per, dtype=torch.int32, device=device)
    return model, (x.requires_grad_(), offs)
