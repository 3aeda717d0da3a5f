"""Pieces shared by the reference models: rotary embeddings, SwiGLU MLP and build()."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator, Mapping, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

INIT_STD = 0.02

M = TypeVar("M", bound=nn.Module)


def rope_cos_sin(
    seq: int, dim: int, theta: float, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq, dim) in the rotate-half layout.

    Computed in forward rather than stored in a buffer so that meta-device models need
    no re-materialisation and the tables never appear as module state.
    """
    inv_freq = theta ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x of shape (..., seq, dim) by the tables from ``rope_cos_sin``."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), the Llama / DeepSeek dense MLP."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def init_weights(model: nn.Module, generator: torch.Generator | None) -> None:
    """Normal(0, 0.02) matrices, zero biases, unit norm weights."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, INIT_STD, generator=generator)
            elif name.endswith("bias"):
                param.zero_()
            else:
                param.fill_(1.0)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


class RopeDecoder(nn.Module):
    """A stack of pre-norm blocks sharing one RoPE table (Llama, DeepSeek); with
    ``config.vocab_size`` set it maps token ids to logits."""

    def __init__(self, config: Any, block: Callable[[Any, int], nn.Module], rope_dim: int) -> None:
        super().__init__()
        self.config = config
        self.rope_dim = rope_dim
        lm = config.vocab_size is not None
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden) if lm else None
        self.layers = nn.ModuleList([block(config, i) for i in range(config.layers)])
        self.norm = nn.RMSNorm(config.hidden, eps=config.norm_eps)
        self.output = nn.Linear(config.hidden, config.vocab_size, bias=False) if lm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        cos, sin = rope_cos_sin(x.shape[1], self.rope_dim, self.config.rope_theta, x.device, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        x = self.norm(x)
        return x if self.output is None else self.output(x)


def builder(model_cls: type[M], sizes: Mapping[str, Any]) -> Callable[..., tuple[M, tuple[torch.Tensor, ...]]]:
    """The ``build`` function of a model module."""

    def build(
        size: str = "tiny",
        *,
        layers: int | None = None,
        batch: int | None = None,
        seq: int | None = None,
        dtype: torch.dtype | None = None,
        device: str | torch.device | None = None,
        seed: int = 0,
    ) -> tuple[M, tuple[torch.Tensor, ...]]:
        """Model and example inputs: hidden states (batch, seq, hidden), or token ids for LM sizes.

        ``tiny`` builds float32 on the CPU with deterministic weights from ``seed``; ``real`` (and
        the other real-size variants, such as llama's ``70b``)
        builds bfloat16 on the meta device, allocating nothing of the model's size.
        """
        return _build(model_cls, sizes, size, layers=layers, batch=batch, seq=seq, dtype=dtype,
                      device=device, seed=seed)

    return build


def _build(
    model_cls: type[M],
    sizes: Mapping[str, Any],
    size: str,
    *,
    layers: int | None,
    batch: int | None,
    seq: int | None,
    dtype: torch.dtype | None,
    device: str | torch.device | None,
    seed: int,
) -> tuple[M, tuple[torch.Tensor, ...]]:
    if size not in sizes:
        raise ValueError(f"unknown size {size!r}; valid sizes: {', '.join(sizes)}")
    overrides = {"layers": layers, "batch": batch, "seq": seq}
    config = dataclasses.replace(
        sizes[size], **{k: v for k, v in overrides.items() if v is not None}
    )
    real = not size.startswith("tiny")  # "real" and the other real-size variants ("70b")
    dtype = dtype or (torch.bfloat16 if real else torch.float32)
    device = torch.device(device or ("meta" if real else "cpu"))

    # Construct in place with the target dtype: no fp32 copy of a real-size model is
    # ever allocated, and unlike .to()/.to_empty() this also works under FakeTensorMode.
    generator = None if device.type == "meta" else torch.Generator(device).manual_seed(seed)
    with _default_dtype(dtype), device:
        model = model_cls(config)
    if generator is not None:
        init_weights(model, generator)

    shape = (config.batch, config.seq)
    if config.vocab_size is None:
        x = torch.randn(
            *shape, config.hidden, generator=generator, device=device, dtype=dtype
        ).requires_grad_()
    else:
        x = torch.randint(config.vocab_size, shape, generator=generator, device=device)
    return model, (x,)
