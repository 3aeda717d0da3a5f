"""torch's FP8 GEMMs, the kernel entry points the providers (``providers.py``,
``blockwise_gemm.py``) call: ``torch._scaled_mm`` (tensorwise and rowwise scales),
``torch._scaled_grouped_mm`` (token-grouped and batched, rowwise scales) and
``torch.nn.functional.scaled_mm`` (blockwise scales), each called with keyword arguments so that a
signature change upstream fails here, and where a supported torch lacks one, what stands in or
why not."""

from __future__ import annotations

import torch

from .._compat import TORCH_VERSION, TORCH_VERSION_STR


def scaled_mm(a: torch.Tensor, b: torch.Tensor, *, scale_a: torch.Tensor, scale_b: torch.Tensor,
              bias: torch.Tensor | None, out_dtype: torch.dtype,
              use_fast_accum: bool = False) -> torch.Tensor:
    """torch's FP8 GEMM (``torch._scaled_mm``), tensorwise or rowwise scales. torch 2.11's CPU
    kernel (oneDNN) takes one scale per tensor only: there a rowwise call is its arithmetic, the
    dequantized operands multiplied in fp32 and rounded once (what 2.13's CPU kernel computes)."""
    if (a.device.type == "cpu" and TORCH_VERSION < (2, 13)
            and (scale_a.numel() != 1 or scale_b.numel() != 1)):
        out = (a.float() * scale_a) @ (b.float() * scale_b)
        if bias is not None:
            out = out + bias.float()
        return out.to(out_dtype)
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype,
                            use_fast_accum=use_fast_accum)


def blockwise_scaled_mm_missing() -> str | None:
    """None where this torch has the blockwise FP8 GEMM (``torch.nn.functional.scaled_mm`` with
    ``ScalingType.BlockWise1x128``/``BlockWise128x128``, torch >= 2.10), else why not."""
    functional = torch.nn.functional
    scaling = getattr(functional, "ScalingType", None)
    if not hasattr(functional, "scaled_mm") or scaling is None or not all(
            hasattr(scaling, n) for n in ("BlockWise1x128", "BlockWise128x128")):
        return (f"torch {TORCH_VERSION_STR} has no blockwise FP8 GEMM "
                "(torch.nn.functional.scaled_mm with ScalingType.BlockWise1x128, torch >= 2.10)")
    return None


def blockwise_scaled_mm(a: torch.Tensor, b: torch.Tensor, *, scale_a: torch.Tensor,
                        recipe_a: str, scale_b: torch.Tensor, recipe_b: str,
                        out_dtype: torch.dtype, use_fast_accum: bool) -> torch.Tensor:
    """torch's blockwise FP8 GEMM ``a @ b``: a (M, K) row-major, b (K, N) column-major; the
    recipes are ``ScalingType`` member names."""
    functional = torch.nn.functional
    return functional.scaled_mm(a, b, scale_a, getattr(functional.ScalingType, recipe_a),
                                scale_b, getattr(functional.ScalingType, recipe_b),
                                output_dtype=out_dtype, use_fast_accum=use_fast_accum)



def has_scaled_grouped_mm() -> bool:
    """Whether this torch has ``torch._scaled_grouped_mm`` (2.11.0, 2.13.0, 2.14.1 and 2.15.0 all
    do, with one schema: ``(self, mat2, scale_a, scale_b, offs=None, bias=None, scale_result=None,
    out_dtype=None, use_fast_accum=False)``; CUDA kernels only, E4M3 operands, fp32 rowwise
    scales)."""
    return hasattr(torch, "_scaled_grouped_mm")


def scaled_grouped_mm(a: torch.Tensor, b: torch.Tensor, *, scale_a: torch.Tensor,
                      scale_b: torch.Tensor, offs: torch.Tensor,
                      out_dtype: torch.dtype, use_fast_accum: bool = False) -> torch.Tensor:
    """torch's grouped FP8 GEMM (``torch._scaled_grouped_mm``): a (T, K) row-major, b (G, K, N)
    column-major, scale_a (T,), scale_b (G, N), token groups ending at ``offs``."""
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=out_dtype,
                                    use_fast_accum=use_fast_accum)


