"""A fixed synthetic language-modelling task for comparing numerics of training runs.

Tokens follow a hidden random bigram map with probability ``p_follow`` and are uniform noise
otherwise, so the loss has a known floor above zero (the noise's entropy) and runs can be
compared by their final loss rather than by how fast they reach zero.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


def batches(vocab: int, batch: int, seq: int, steps: int, *, seed: int = 0,
            p_follow: float = 0.7) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    follow = torch.randperm(vocab, generator=g)
    out = []
    for _ in range(steps):
        tokens = torch.empty(batch, seq + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(vocab, (batch,), generator=g)
        for t in range(seq):
            noise = torch.randint(vocab, (batch,), generator=g)
            keep = torch.rand(batch, generator=g) < p_follow
            tokens[:, t + 1] = torch.where(keep, follow[tokens[:, t]], noise)
        out.append(tokens)
    return out


def loss_floor(vocab: int, p_follow: float = 0.7) -> float:
    """Cross-entropy of the best possible predictor of the task."""
    p_hit = p_follow + (1 - p_follow) / vocab
    p_miss = (1 - p_follow) / vocab
    return -(p_hit * math.log(p_hit) + (vocab - 1) * p_miss * math.log(p_miss))


def train(model: nn.Module, step_fn: Callable[[torch.Tensor], torch.Tensor],
          data: list[torch.Tensor], *, lr: float = 3e-3,
          autocast: torch.dtype | None = torch.bfloat16) -> list[float]:
    """Train with AdamW; ``step_fn(tokens) -> logits`` may be a compiled model. Returns losses."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    for tokens in data:
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            logits = step_fn(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


class bf16_gemms_in_fp32(TorchDispatchMode):
    """Within it, a bf16 ``mm`` / ``addmm`` / ``bmm`` runs as the fp32 GEMM of its bf16 operands,
    rounded to bf16 once: what a GPU's bf16 GEMM computes (fp32 accumulation, one rounding), in
    another summation order than the CPU's own bf16 kernel, which accumulates in fp32 as well.

    For CPU reference runs only: on CPUs without AVX-512 BF16 (this project's CI machines) torch's
    bf16 GEMM is a scalar loop, 75-100x slower than fp32 (DEVELOPERS.md); the tiny Llama's 200-step
    bf16 run took 42.6 s with it and 10.7 s within this mode, final loss 2.5356 vs 2.5347 (torch
    2.13, one core). torch.compile compiles under it (``ignore_compile_internals``: without it,
    Dynamo would run the model eagerly) and a graph compiled with ``codegen="eager"`` runs its aten
    calls through it."""

    _GEMMS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                        torch.ops.aten.bmm.default})

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._GEMMS and args[-1].dtype == torch.bfloat16 and args[-1].device.type == "cpu":
            args = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
            return func(*args, **kwargs).to(torch.bfloat16)
        return func(*args, **kwargs)
