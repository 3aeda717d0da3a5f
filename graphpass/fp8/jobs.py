"""The FP8 GEMM provider interface (``Provider``), and the GEMMs of a grouped or batched FP8
GEMM as jobs: what a provider runs one by one, or all at once (``gemm_many``), where it has no
grouped or batched GEMM of its own. The providers are in ``providers.py`` and ``te.py``."""

from __future__ import annotations

from typing import NamedTuple, Optional, Protocol

import torch
from torch import Tensor

from . import recipes
from .cublaslt import pad_last

TOKEN_ALIGN = 16  # tokens: where the 2d x 2d grouped GEMM's groups may start (its contraction)


class Job(NamedTuple):
    """One GEMM of a grouped or batched GEMM: ``out = dequant(a) @ dequant(b).T (+ bias)``,
    written into ``out``, a view of the whole result."""

    a: Tensor
    a_scale_inv: Tensor
    b: Tensor
    b_scale_inv: Tensor
    out: Tensor
    bias: Optional[Tensor] = None


class Provider(Protocol):
    """An FP8 GEMM provider: ``dequant(a) @ dequant(b).T (+ bias)`` of operands quantized by
    :mod:`graphpass.fp8.recipes` (both K-major). A provider states ``name``, ``supports`` and
    ``gemm``; ``gemm_many``, ``grouped_gemm`` and ``batched_gemm`` are declared here with their
    defaults (one ``gemm`` per job, one job per token group or expert), which a provider with
    a grouped kernel of its own overrides. ``recipe`` is a ``Recipe`` or its key."""

    name: str

    def supports(self, recipe: recipes.Recipe | str, device: torch.device) -> str | None:
        """None when this provider can run ``recipe`` on ``device``, else the reason why not."""
        ...

    def gemm(self, a: Tensor, a_scale_inv: Tensor, b: Tensor, b_scale_inv: Tensor,
             recipe: recipes.Recipe | str, a_role: str, b_role: str, out_dtype: torch.dtype,
             bias: Optional[Tensor], *, fast_accum: bool = False) -> Tensor:
        ...

    def gemm_many(self, jobs: list[Job], recipe: recipes.Recipe | str, a_role: str, b_role: str,
                  out_dtype: torch.dtype, *, fast_accum: bool = False) -> None:
        """Every job's GEMM, written into its job's ``out``: one ``gemm`` per job."""
        for j in jobs:
            j.out.copy_(self.gemm(j.a, j.a_scale_inv, j.b, j.b_scale_inv, recipe, a_role, b_role,
                                  out_dtype, j.bias, fast_accum=fast_accum))

    def grouped_gemm(self, a: Tensor, a_scale_inv: Tensor, b: Tensor, b_scale_inv: Tensor,
                     offs: Tensor, recipe: recipes.Recipe | str, a_role: str, b_role: str,
                     out_dtype: torch.dtype, bias: Optional[Tensor], *,
                     fast_accum: bool = False) -> Tensor:
        """``fp8_gemm`` with offsets (token groups): one job per non-empty group."""
        return per_group_gemm(a, a_scale_inv, b, b_scale_inv, offs, recipe, a_role, b_role,
                              out_dtype, bias, self, fast_accum=fast_accum)

    def batched_gemm(self, a: Tensor, a_scale_inv: Tensor, b: Tensor, b_scale_inv: Tensor,
                     recipe: recipes.Recipe | str, a_role: str, b_role: str,
                     out_dtype: torch.dtype, bias: Optional[Tensor], *,
                     fast_accum: bool = False) -> Tensor:
        """``fp8_gemm`` over 3-D operands (G, M, K) x (G, N, K): (G, M, N), one job per group."""
        return per_expert_gemm(a, a_scale_inv, b, b_scale_inv, recipe, a_role, b_role, out_dtype,
                               bias, self, fast_accum=fast_accum)


def aligns_tokens(recipe: recipes.Recipe | str) -> bool:
    """Whether a token-grouped quantize writes its columnwise copy (the wgrad operand) in the
    16-aligned token layout (``providers.aligned_token_sources``): under the rowwise recipe,
    whose wgrad runs as one 2d x 2d ``torch._scaled_grouped_mm`` wherever the grouped kernel
    runs. The other recipes' columnwise copies are (K, T), group g the columns
    ``offs[g-1]:offs[g]``: tensorwise ones also go to TE's grouped GEMM and to per-group
    ``_scaled_mm`` calls (HYBRID's E5M2 gradients), which need no alignment, and the block
    recipes' scales restart per group."""
    return recipes.as_recipe(recipe).per_row


def run_jobs(jobs: list[Job], recipe, a_role, b_role, out_dtype, provider: Provider, *,
             fast_accum: bool = False) -> None:
    """Each job's GEMM, by the provider's ``gemm_many`` (TE's grouped GEMM, or one ``gemm`` per
    job)."""
    if jobs:
        provider.gemm_many(jobs, recipe, a_role, b_role, out_dtype, fast_accum=fast_accum)


def per_expert_gemm(a, a_scale_inv, b, b_scale_inv, recipe, a_role, b_role, out_dtype, bias,
                    provider: Provider, *, fast_accum: bool = False) -> Tensor:
    """``fp8_gemm`` over 3-D operands (G, M, K) x (G, N, K): (G, M, N), one job per group."""
    out = a.new_empty((a.shape[0], a.shape[1], b.shape[1]), dtype=out_dtype)
    run_jobs([Job(a[i], a_scale_inv[i], b[i], b_scale_inv[i], out[i], bias)
              for i in range(a.shape[0])], recipe, a_role, b_role, out_dtype, provider,
             fast_accum=fast_accum)
    return out


def per_group_gemm(a, a_scale_inv, b, b_scale_inv, offs, recipe, a_role, b_role, out_dtype, bias,
                   provider: Provider, *, fast_accum: bool = False) -> Tensor:
    """``fp8_gemm`` with offsets as one job per non-empty group on the group's slices. A wgrad's
    (2-D b) operands in the aligned token layout (``aligns_tokens``) hold group g in the columns
    from its aligned start, the group's own tokens first; the job takes those ``n_g`` columns,
    the same slice as the (K, T) layout's."""
    if bias is not None:
        raise ValueError("a grouped FP8 GEMM takes no bias")
    rec = recipes.as_recipe(recipe)
    split_k = b.dim() == 2
    if split_k:
        out = a.new_zeros((offs.shape[0], a.shape[0], b.shape[0]), dtype=out_dtype)
    else:
        out = a.new_zeros((a.shape[0], b.shape[-2]), dtype=out_dtype)
    jobs = []
    start, col = 0, 0
    rowwise = rec.per_row
    shape = None if rowwise else rec.block(a_role)  # wgrad's blocks: tokens
    block = shape[1] if shape and split_k else 0
    aligned = split_k and aligns_tokens(rec)
    first = 0  # the group's first column in the aligned token layout
    for g, end in enumerate(offs.tolist()):
        n = end - start
        if n > 0 and not split_k:
            sa = a_scale_inv[g] if a_scale_inv.dim() == 1 else a_scale_inv[start:end]
            jobs.append(Job(a[start:end], sa, b[g], b_scale_inv[g], out[start:end]))
        elif n > 0:
            cols = slice(first, first + n) if aligned else slice(start, end)
            ag, bg = a[:, cols], b[:, cols]
            if block:  # whole blocks of the group: its scale columns, its data zero-padded
                blocks = -(-n // block)
                sa, sb = (s[:, col:col + blocks] for s in (a_scale_inv, b_scale_inv))
                col += blocks
                if n % block:
                    ag, bg = (pad_last(t, -n % block) for t in (ag, bg))
            elif rowwise:  # group g's scale per row of each operand: (G, M) and (G, N)
                sa, sb = a_scale_inv[g][:, None], b_scale_inv[g][:, None]
            else:
                sa, sb = a_scale_inv[g], b_scale_inv[g]
            jobs.append(Job(ag.contiguous(), sa, bg.contiguous(), sb, out[g]))
        first += -(-n // TOKEN_ALIGN) * TOKEN_ALIGN
        start = end
    run_jobs(jobs, recipe, a_role, b_role, out_dtype, provider, fast_accum=fast_accum)
    return out
