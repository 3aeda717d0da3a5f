"""Transformer Engine as an FP8 GEMM provider (``Config(kernels="te")``).

graphpass quantizes in its own graph nodes, bit-exact with TE's recipes, and hands TE's
``general_gemm`` the 1-byte operands wrapped in TE's storage class, so the partitioner keeps
seeing (and saving) plain tensors. Both operands are K-major, which is TE's ``"TN"`` layout:
``general_gemm(A, B, layout="TN")`` computes ``B @ A.T``, so
``a @ b.T`` is ``general_gemm(b, a)``.

The GEMMs of a grouped or batched ``fp8_gemm`` (MoE experts: one per token group or expert, and
the per-group wgrads) go to TE in one ``general_grouped_gemm`` call, TE's multi-stream grouped
GEMM (what its ``GroupedLinear`` calls), not one ``general_gemm`` per group.

Only per-tensor scaling (``fp8="tensorwise"``) is wired to TE here, in both of TE's formats for it
(``fp8_format="hybrid"``: ``Format.HYBRID``, E5M2 gradients; ``"e4m3"``: ``Format.E4M3``): each
operand's storage carries its own FP8 dtype, which is all TE's GEMM reads of the format. TE's
block-scaled storages expect padded, GEMM-swizzled scale layouts that differ between TE releases.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import recipes
from .cublaslt import own_scalar, pad_contraction
from .jobs import Job, Provider

# The TE entry points graphpass calls, with the keyword arguments it passes; the TE test checks
# them against the installed TE's real signatures.
CALLS = {
    "transformer_engine.pytorch.cpp_extensions.general_gemm": (
        "out_dtype", "layout", "bias", "use_split_accumulator"),
    "transformer_engine.pytorch.cpp_extensions.general_grouped_gemm": (
        "quantization_params", "out_dtype", "layout", "single_output", "use_split_accumulator"),
    "transformer_engine.pytorch.tensor.storage.float8_tensor_storage.Float8TensorStorage": (
        "data", "fp8_scale_inv", "fp8_dtype", "data_transpose", "quantizer"),
}


class TransformerEngine(Provider):
    name = "te"

    def __init__(self) -> None:
        import transformer_engine.pytorch  # noqa: F401  (fails clearly where TE is absent)
        import transformer_engine_torch as tex
        from transformer_engine.pytorch.cpp_extensions import general_gemm, general_grouped_gemm
        from transformer_engine.pytorch.tensor.storage.float8_tensor_storage import (
            Float8TensorStorage,
        )

        self._gemm = general_gemm
        self._grouped_gemm = general_grouped_gemm
        self._storage = Float8TensorStorage
        self._te_dtype = {torch.float8_e4m3fn: tex.DType.kFloat8E4M3,
                          torch.float8_e5m2: tex.DType.kFloat8E5M2}

    def supports(self, recipe: recipes.Recipe | str, device: torch.device) -> str | None:
        if device.type != "cuda":
            return "Transformer Engine kernels need CUDA"
        rec = recipes.as_recipe(recipe)
        if not rec.per_tensor:
            return (f"the TE provider runs fp8='tensorwise', not {rec.quantization_key!r}; use "
                    "kernels='reference'")
        return None

    def _wrap(self, data: Tensor, scale_inv: Tensor):
        return self._storage(data=data, fp8_scale_inv=scale_inv.reshape(1).float(),
                             fp8_dtype=self._te_dtype[data.dtype], data_transpose=None,
                             quantizer=None)

    def _operands(self, a, a_scale_inv, b, b_scale_inv):
        """TE's ``(A, B)`` for ``a @ b.T``: ``(b, a)`` wrapped, under cuBLASLt's operand rules
        (fp8/cublaslt.py) as for ``torch._scaled_mm``."""
        a, b = pad_contraction(a, b)
        return (self._wrap(b, own_scalar(b_scale_inv)), self._wrap(a, own_scalar(a_scale_inv)))

    def gemm(self, a, a_scale_inv, b, b_scale_inv, recipe, a_role, b_role, out_dtype,
             bias: Optional[Tensor], *, fast_accum: bool = False):
        # TE's FP8 GEMMs take a bf16/fp16 bias in the epilogue (linear.py casts fp32 to bf16).
        fused_bias = bias is not None and out_dtype in (torch.bfloat16, torch.float16)
        out = self._gemm(
            *self._operands(a, a_scale_inv, b, b_scale_inv), out_dtype=out_dtype,
            layout="TN", bias=bias.to(out_dtype) if fused_bias else None,
            use_split_accumulator=not fast_accum,
        )[0]
        if bias is not None and not fused_bias:
            out = out + bias.to(out_dtype)
        return out

    def gemm_many(self, jobs: list[Job], recipe, a_role, b_role, out_dtype, *,
                  fast_accum: bool = False) -> None:
        """Every job's GEMM in one ``general_grouped_gemm``, each written into its job's ``out``
        (``single_output=False``: the outs are views TE writes in place). Jobs with a bias (none
        of graphpass's expert lowerings makes one) run one ``general_gemm`` each."""
        if any(j.bias is not None for j in jobs):
            for j in jobs:
                j.out.copy_(self.gemm(j.a, j.a_scale_inv, j.b, j.b_scale_inv, recipe, a_role,
                                      b_role, out_dtype, j.bias, fast_accum=fast_accum))
            return
        operands = [self._operands(j.a, j.a_scale_inv, j.b, j.b_scale_inv) for j in jobs]
        self._grouped_gemm(
            [a for a, _ in operands], [b for _, b in operands], [j.out for j in jobs],
            quantization_params=[None] * len(jobs), out_dtype=out_dtype, layout="TN",
            single_output=False, use_split_accumulator=not fast_accum)
