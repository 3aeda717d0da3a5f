"""The FP8 activation cache's two graph ops: ``graphpass::cache_quantize`` and
``graphpass::cache_dequantize`` (``Config.fp8_activation_cache``).

A saved activation of any shape is stored as FP8 data of the same shape plus fp32 scales, and the
backward reads it back dequantized to its original dtype. Stateless, with fake implementations,
as separate nodes: torch's min-cut sees (and counts) the 1-byte data and the report shows it.
The arithmetic is :mod:`graphpass.fp8.recipes`' (TE's), on the tensor viewed as rows of its last
dimension.

Formats (``Config.fp8_activation_cache_format``) and the error of one element ``x`` (``x̂`` its dequantized
value, ``s`` the scale its block or tensor was multiplied by, ``1/s`` the stored ``scale_inv``),
for finite inputs:

* ``e4m3_1x128``: E4M3, one fp32 scale ``448 / amax`` per 1x128 block along the last dimension.
* ``e4m3_1x128_pow2`` (the default): the same with the scale rounded down to a power of two
  (DeepSeek-V3), stored as one E8M0 byte (its exponent, exact) instead of fp32: on
  Llama-3-8B's SwiGLU, 1.75 MiB of scales instead of 7 MiB per layer.
* ``e4m3_tensor``: E4M3, one scale ``448 / amax`` per tensor.
* ``e5m2_tensor``: E5M2, one scale ``57344 / amax`` per tensor (torch's own pass stores E5M2).

``x·s`` is at most the format's largest finite value, so the cast never saturates a finite
value, and rounds to nearest even: an element whose scaled value is normal (``|x·s| >= 2**-6``
E4M3, ``2**-14`` E5M2) is off by at most half an ulp, ``2**-(m+1)`` relative with ``m``
mantissa bits; a subnormal one by half the subnormal spacing, absolute. So

    |x̂ - x| <= 2**-(m+1) · |x| + 2**(e_min - m - 1) / s        (plus fp32 rounding, 2**-22 relative)

with ``m = 3, e_min = -6`` for E4M3 (``2**-4 |x| + 2**-10 / s``) and ``m = 2, e_min = -14`` for
E5M2 (``2**-3 |x| + 2**-17 / s``), and, for a bfloat16 or float16 original, one more rounding to
that dtype on the way back (``2**-9`` resp. ``2**-11`` relative). A power-of-two scale changes
only ``s`` (at most a factor 2 smaller, so the subnormal term at most 2x larger); a block scale
makes ``1/s`` its block's ``amax / 448`` instead of the tensor's.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from . import recipes

# format -> (recipe, the role whose fp8 dtype and block shape it uses)
FORMATS: dict[str, tuple[recipes.Recipe, str]] = {
    "e4m3_1x128": (recipes.BLOCKWISE_NOPOW2, "input"),
    "e4m3_1x128_pow2": (recipes.BLOCKWISE, "input"),
    "e4m3_tensor": (recipes.TENSORWISE_E4M3, "input"),
    "e5m2_tensor": (recipes.TENSORWISE, "grad"),
}
# Mantissa bits and the smallest normal exponent of each format's fp8 dtype, for the error bound.
_BITS = {recipes.E4M3: (3, -6), recipes.E5M2: (2, -14)}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
"""The dtypes a cached activation may have (the recipes' input dtypes)."""


def _rows(x: Tensor) -> Tensor:
    """``x`` as a matrix of rows of its last dimension (a 0-d or 1-d tensor is one row)."""
    return x.reshape(1, -1) if x.dim() < 2 else x.reshape(-1, x.shape[-1])


def _check(fmt: str) -> tuple[recipes.Recipe, str]:
    if fmt not in FORMATS:
        raise ValueError(f"unknown fp8_cache_format {fmt!r}; valid formats are: "
                         + ", ".join(map(repr, FORMATS)))
    return FORMATS[fmt]


def _cache_quantize(x: Tensor, fmt: str) -> list[Tensor]:
    """``[data, scale_inv]``: ``data`` in ``x``'s shape (contiguous) and the fmt's fp8 dtype;
    ``scale_inv`` () per tensor, (rows, ceil(last/128)) per block."""
    recipe, role = _check(fmt)
    data, scale_inv = recipes.quantize(_rows(x), recipe, role)
    if recipe.power_2_scales:  # a power of two: its E8M0 byte holds it exactly
        scale_inv = recipes.float_to_e8m0(scale_inv)
    return [data.reshape(x.shape), scale_inv]


def _cache_dequantize(data: Tensor, scale_inv: Tensor, fmt: str, dtype: torch.dtype,
                      stride: list[int]) -> Tensor:
    """The cached value in ``dtype``, laid out with ``stride`` (the original's)."""
    recipe, role = _check(fmt)
    if recipe.power_2_scales:
        scale_inv = recipes.e8m0_to_float(scale_inv)
    values = recipes.dequantize(_rows(data), scale_inv, recipe, role, dtype=dtype)
    out = torch.empty_strided(data.shape, stride, dtype=dtype, device=data.device)
    return out.copy_(values.reshape(data.shape))


def _cache_dequantize_fake(data: Tensor, scale_inv: Tensor, fmt: str, dtype: torch.dtype,
                           stride: list[int]) -> Tensor:
    return torch.empty_strided(data.shape, stride, dtype=dtype, device=data.device)


cache_quantize = torch.library.custom_op("graphpass::cache_quantize", _cache_quantize,
                                         mutates_args=())
cache_quantize.register_fake(_cache_quantize)  # plain tensor arithmetic: exact fake metadata
cache_dequantize = torch.library.custom_op("graphpass::cache_dequantize", _cache_dequantize,
                                           mutates_args=())
cache_dequantize.register_fake(_cache_dequantize_fake)


def _dequantize_copy(data: Tensor, scale_inv: Tensor, recipe: str, dtype: torch.dtype) -> Tensor:
    """The FP8 lowering's columnwise copy of a linear input (data (K, M)), dequantized back to
    the (M, K) input in ``dtype``: the cache reuses the copy wgrad needs anyway."""
    return recipes.dequantize(data, scale_inv, recipe, "input", columnwise=True,
                              dtype=dtype).contiguous()


def _dequantize_copy_fake(data: Tensor, scale_inv: Tensor, recipe: str,
                          dtype: torch.dtype) -> Tensor:
    return data.new_empty((data.shape[1], data.shape[0]), dtype=dtype)


dequantize_copy = torch.library.custom_op("graphpass::cache_dequantize_copy", _dequantize_copy,
                                          mutates_args=())
dequantize_copy.register_fake(_dequantize_copy_fake)


def fp8_dtype(fmt: str) -> torch.dtype:
    recipe, role = _check(fmt)
    return recipes.fp8_dtype(recipe, role)


def error_bound(x: Tensor, fmt: str) -> Tensor:
    """The largest ``|x̂ - x|`` the module docstring allows for each element of a float32 ``x``
    (before the rounding back to a narrower original dtype)."""
    data, scale_inv = _cache_quantize(x, fmt)
    mantissa, e_min = _BITS[data.dtype]
    recipe, _ = _check(fmt)
    if recipe.power_2_scales:
        scale_inv = recipes.e8m0_to_float(scale_inv)
    per_element = scale_inv.float()
    if recipe.scaling is recipes.Scaling.BLOCKWISE:
        rows = _rows(x)
        per_element = scale_inv.repeat_interleave(128, dim=1)[:, :rows.shape[1]].reshape(x.shape)
    bound = 2.0 ** -(mantissa + 1) * x.float().abs() + 2.0 ** (e_min - mantissa - 1) * per_element
    return bound * (1 + 2.0 ** -20)  # the fp32 multiplications by s and by 1/s


# The graph ops, for passes that insert or match them (importing this module registers them).
CACHE_QUANTIZE = torch.ops.graphpass.cache_quantize.default
CACHE_DEQUANTIZE = torch.ops.graphpass.cache_dequantize.default
CACHE_DEQUANTIZE_COPY = torch.ops.graphpass.cache_dequantize_copy.default
