"""The two FP8 graph ops: ``graphpass::quantize`` and ``graphpass::fp8_gemm``.

They stay separate nodes so the partitioner sees the 1-byte tensors between them and can save,
recompute or offload them like any other value. Both have fake implementations (shapes only) and
the GEMM has a FLOP formula, so torch's partitioner and its budget solver can cost them.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from . import providers, recipes


USAGES = ("rowwise", "columnwise", "both")


def _quantize(x: Tensor, recipe: str, role: str, usage: str) -> list[Tensor]:
    """FP8 copies of a 2-D tensor in ``role`` under ``recipe``: ``[data, scale_inv]`` per usage.

    ``usage`` is ``"rowwise"`` (data (M, K)), ``"columnwise"`` (the transposed copy, data (K, M),
    blocks down x's columns, which TN-only FP8 GEMMs need for wgrad and dgrad) or ``"both"``
    (rowwise then columnwise, from one read of x, as Transformer Engine's quantizers do).
    See :mod:`graphpass.fp8.recipes` for the layouts.
    """
    if usage not in USAGES:
        raise ValueError(f"unknown quantize usage {usage!r}; valid usages are {USAGES}")
    if x.dim() == 3:
        # A group of matrices (one per MoE expert): each quantized on its own, so every scale,
        # tensorwise ones included, belongs to one expert (as in TE's GroupedLinear).
        per_group = [_quantize(g, recipe, role, usage) for g in x.unbind(0)]
        return [torch.stack(parts) for parts in zip(*per_group)]
    out: list[Tensor] = []
    for columnwise in {"rowwise": (False,), "columnwise": (True,), "both": (False, True)}[usage]:
        out += recipes.quantize(x, recipe, role, columnwise=columnwise)
    return out


def _quantize_fake(x: Tensor, recipe: str, role: str, usage: str) -> list[Tensor]:
    # The recipe is plain tensor arithmetic, so it runs on fake tensors and gives exact
    # metadata; a group's metadata is one member's with the group dimension in front (tracing
    # one member, not DeepSeek-V3's 256: 0.1 s instead of 13 s per quantize under fake tensors).
    if x.dim() == 3:
        return [t.new_empty((x.shape[0], *t.shape)) for t in _quantize(x[0], recipe, role, usage)]
    return _quantize(x, recipe, role, usage)


def _quantize_op(x: Tensor, recipe: str, role: str, usage: str) -> list[Tensor]:
    # Run eagerly (codegen="eager", block recipes, quantizes Inductor leaves as one op), a
    # tensorwise pair from one amax: the columnwise copy is the rowwise one transposed, bit for
    # bit (same scale, elementwise cast), so one 1-byte transpose replaces a second amax and cast
    # over x. Inductor inlines ``_quantize`` itself (fp8/inductor.py) and fuses both copies.
    if usage == "both" and recipe == "tensorwise" and x.dim() == 2:
        data, scale_inv = recipes.quantize(x, recipe, role)
        return [data, scale_inv, data.t().clone(memory_format=torch.contiguous_format),
                scale_inv.clone()]
    return _quantize(x, recipe, role, usage)


quantize = torch.library.custom_op("graphpass::quantize", _quantize_op, mutates_args=())
quantize.register_fake(_quantize_fake)


# FP8 all-gather (passes/fp8_all_gather.py): each rank's amax, reduced over the group by the
# graph's all-reduce, then each rank quantizes its shard with the group's amax.
@torch.library.custom_op("graphpass::amax", mutates_args=())
def amax(x: Tensor) -> Tensor:
    """The fp32 amax of ``x`` as tensorwise scaling reads it (NaN ignored), shape ()."""
    return recipes.tensor_amax(x)


@amax.register_fake
def _(x):
    return x.new_empty((), dtype=torch.float32)


def _quantize_amax(x: Tensor, amax: Tensor, recipe: str, role: str) -> list[Tensor]:
    """The rowwise tensorwise quantization of a 2-D ``x`` scaled by ``amax`` (not ``x``'s own):
    ``[data, scale_inv]``."""
    return list(recipes.quantize(x, recipe, role, amax=amax))


quantize_amax = torch.library.custom_op("graphpass::quantize_amax", _quantize_amax,
                                        mutates_args=())
quantize_amax.register_fake(_quantize_amax)  # plain tensor arithmetic: exact on fake tensors


# FP8 GEMMs are TN-only (cuBLASLt on Hopper, TE): both operands row-major, K contiguous. Under
# Inductor an inlined quantize may write its FP8 copy in its input's stride order (a transposed
# gradient's), so the GEMM asks Inductor for its inputs in the strides of the traced graph, where
# every quantize output is contiguous; ``_k_major`` below guards any other caller.
@torch.library.custom_op("graphpass::fp8_gemm", mutates_args=(),
                         tags=(torch.Tag.needs_fixed_stride_order,))
def fp8_gemm(
    a: Tensor,
    a_scale_inv: Tensor,
    b: Tensor,
    b_scale_inv: Tensor,
    recipe: str,
    roles: str,
    out_dtype: torch.dtype,
    bias: Optional[Tensor],
    kernel: str,
) -> Tensor:
    """``dequant(a) @ dequant(b).T (+ bias)``: a TN GEMM, both operands K-major. With 3-D
    operands (G, M, K) and (G, N, K), one such GEMM per group: (G, M, N).

    ``roles`` is ``"<role of a>,<role of b>"`` (``input,weight`` for fprop, ``grad,weight`` for
    dgrad, ``grad,input`` for wgrad, ``input,grad`` for the wgrad of a weight stored [in, out]);
    ``kernel`` names the provider that runs it.
    """
    a_role, b_role = roles.split(",")
    a, b = _k_major(a), _k_major(b)
    if a.dim() == 3:  # grouped: one GEMM per group (MoE expert), same layouts
        return torch.stack([
            providers.get(kernel).gemm(a[i], a_scale_inv[i], b[i], b_scale_inv[i], recipe, a_role,
                                       b_role, out_dtype, bias)
            for i in range(a.shape[0])])
    return providers.get(kernel).gemm(a, a_scale_inv, b, b_scale_inv, recipe, a_role, b_role,
                                      out_dtype, bias)


def _k_major(t: Tensor) -> Tensor:
    """``t`` with its last dimension contiguous, copied only where it is not."""
    k_major = t.stride(-1) == 1 and all(s >= t.shape[-1] for s in t.stride()[:-1])
    return t if k_major else t.contiguous()


@fp8_gemm.register_fake
def _(a, a_scale_inv, b, b_scale_inv, recipe, roles, out_dtype, bias, kernel):
    return a.new_empty((*a.shape[:-1], b.shape[-2]), dtype=out_dtype)


@register_flop_formula(torch.ops.graphpass.fp8_gemm)
def _gemm_flops(a_shape, a_scale_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    *groups, m, k = a_shape
    return 2 * (groups[0] if groups else 1) * m * b_shape[-2] * k


# The graph ops, for passes that insert or match them (importing this module registers them).
QUANTIZE = torch.ops.graphpass.quantize.default
FP8_GEMM = torch.ops.graphpass.fp8_gemm.default
AMAX = torch.ops.graphpass.amax.default
QUANTIZE_AMAX = torch.ops.graphpass.quantize_amax.default
