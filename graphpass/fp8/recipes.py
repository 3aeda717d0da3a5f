"""FP8 quantization recipes in pure torch, bit-exact with Transformer Engine (TE) 2.20.

Numerics follow Transformer Engine's quantize kernels (``transformer_engine/common``: the
current-scaling, block-scaling and MXFP8 cast kernels and their scale computation); layouts
follow TE's row- and column-wise ``Float8Tensor`` storages. Everything here is plain tensor arithmetic: it runs on any
device and on meta/fake tensors, never reads a tensor value on the host, and its output shapes
depend on input shapes only, so it can be traced by torch.compile.

Recipes (``get_recipe(name)``):

* ``"tensorwise"``: TE ``Float8CurrentScaling``. One fp32 scale per tensor, TE's default HYBRID
  format (E4M3 inputs and weights, E5M2 gradients). ``"tensorwise_e4m3"`` is the same recipe in
  TE's ``Format.E4M3`` (E4M3 in every role; ``Config(fp8_format="e4m3")``).
* ``"blockwise"``: TE ``Float8BlockScaling`` (DeepSeek-V3). fp32 scales per 1x128 block for
  activations and gradients, per 128x128 tile for weights; power-of-2 scales by default (TE's
  default). ``"blockwise_nopow2"`` is the same with the plain ``fp8_max / amax`` scales of
  DeepSeek-V3's recipe (TE's ``NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1``;
  ``Config(fp8="blockwise", fp8_pow2_scales=False)``).
* ``"mxfp8"``: TE ``MXFP8BlockScaling``. One E8M0 (power-of-2) scale per 1x32 block.
* ``"rowwise"``: torchao's rowwise recipe (``Float8LinearRecipeName.ROWWISE``), the one
  ``torch._scaled_mm``'s and ``torch._scaled_grouped_mm``'s rowwise kernels take: E4M3 for every
  role, one fp32 scale per row of each GEMM operand along its contraction (a whole row of the
  quantized data: scale shape (R, 1)). ``"rowwise_pow2"`` is the same with scales rounded down to
  powers of two (torchao's ``round_scales_to_power_of_2``; ``Config(fp8_pow2_scales=True)``).
  Scales follow ``compute_scale_from_amax`` as for the TE recipes (an all-zero row gets scale 1;
  torchao floors the amax at 1e-12 instead, which differs only for such rows).

Identity. A ``Recipe`` is the one identity of a recipe and its variant: its scaling granularity
(``Scaling``), the fp8 dtype of each role, power-of-two scales and the accumulation of each GEMM
(``Config.fp8_accumulate``). Graph ops carry it as one key string (``Recipe.key``), which
``get_recipe`` alone parses; ``from_options`` alone derives it from ``Config``'s options. Every
question about a recipe (which granularity, which dtype, which block) is asked of a ``Recipe``,
never by comparing names: ``tests/test_recipe_identity.py`` checks that no other module
compares one. The identity and the numerics it selects are one module on purpose (over 500
lines): each numeric function reads the recipe's fields, and splitting them would spread the
recipe's meaning over two files.

A tensor is quantized in a *role*: ``"input"`` (activation), ``"weight"`` or ``"grad"`` (gradient
of the output). The role picks the fp8 dtype (HYBRID: E5M2 for ``"grad"``, else E4M3) and, for
blockwise, the block shape.

Representation. ``quantize(x)`` of a 2-D ``x`` of shape (M, K) returns ``(data, scale_inv)``,
both contiguous, where dequantization is ``data * scale_inv`` broadcast over each block:

* rowwise: ``data`` is (M, K), blocks run along K (the last dimension).
* columnwise (``columnwise=True``): for *every* recipe, the rowwise quantization of ``x.t()``:
  ``data`` is (K, M) and blocks run along M, i.e. down the columns of ``x``. This is the operand
  a TN-only GEMM needs for wgrad (``dW = dYᵀ·X``). Relation to TE's storage:

  - tensorwise: identical to TE's ``_transpose`` (same scale as the rowwise copy);
  - blockwise: identical to TE's transposed columnwise data (both copies are quantized from high
    precision); a 128x128 weight's columnwise scales are the transpose of its rowwise scales;
  - mxfp8: TE keeps ``columnwise_data`` in the original (M, K) layout with 32x1 blocks; that is
    exactly ``data.t()`` here, and TE's (M/32, K) ``columnwise_scale_inv`` is ``scale_inv.t()``.

Scale shapes are logical, i.e. without TE's padding or GEMM swizzle, for data of shape (R, C)
(R, C = M, K rowwise and K, M columnwise):

* tensorwise: fp32 ``scale_inv`` of shape ();
* blockwise 1x128: fp32 (R, ceil(C/128)); blockwise 128x128: fp32 (ceil(R/128), ceil(C/128));
  a partial last block is padded with zeros, so it gets the amax of its own valid elements;
* mxfp8: uint8 E8M0 biased exponents (R, C/32), value ``2**(e - 127)``; R and C must both be
  multiples of 32 (TE ``MXFP8Quantizer.is_quantizable``), otherwise ValueError;
* rowwise: fp32 (R, 1), one scale per row of the data (columnwise: per column of x).

Special values, as TE's kernels do it:

* NaN never reaches an amax: TE reduces with ``fmaxf``/``__hmax``, which return the non-NaN
  operand. A NaN element therefore does not change its block's scale and quantizes to an fp8 NaN
  (its sign bit is unspecified: eager torch writes 0x7F, inductor-generated code may write 0xFF).
* The cast is round-to-nearest-even with ``satfinite``: anything beyond ±fp8_max, ±inf included,
  becomes ±fp8_max. Here that is a clamp before ``.to(fp8)``, because torch 2.11 gives NaN for an
  out-of-range E4M3 cast and every torch version gives inf for an out-of-range E5M2 cast.
* An inf element makes its amax inf. Tensorwise/blockwise then use scale 1 for that tensor/block
  (the finite values are cast unscaled, saturating). MXFP8 gets exponent 254, so the inf is stored
  as fp8_max and dequantizes back to inf (448 * 2**127 overflows fp32) while the block's finite
  values underflow to 0.
* An all-zero (or all-NaN) block: scale 1 (tensorwise/blockwise), E8M0 byte 0 (mxfp8: 2**-127,
  quantized with the multiplier 2**127); the data is zero either way.

One module because it is one table of numerics: the ``Recipe`` value, the scale arithmetic and
``quantize``/``dequantize``/``qdq`` follow the same TE formulas and are held bit-exact together
(``tests/test_fp8_recipes.py``), and it is where recipe names are compared (outside it only two
functions of ``Config`` do; ``tests/test_recipe_identity.py`` reads the sources for that).
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import struct
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

__all__ = [
    "E4M3",
    "E5M2",
    "ROLES",
    "RECIPE_NAMES",
    "Role",
    "Recipe",
    "TENSORWISE",
    "TENSORWISE_E4M3",
    "BLOCKWISE",
    "MXFP8",
    "ROWWISE",
    "ROWWISE_POW2",
    "BLOCKWISE_NOPOW2",
    "Scaling",
    "ACCUMULATIONS",
    "GEMM_ROLES",
    "as_recipe",
    "from_options",
    "takes_option",
    "is_rowwise",
    "is_tensorwise",
    "fp8_max",
    "get_recipe",
    "fp8_dtype",
    "block_shape",
    "requires_divisibility",
    "compute_scale_from_amax",
    "float_to_e8m0",
    "e8m0_to_float",
    "quantize",
    "tensor_amax",
    "dequantize",
    "qdq",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2

Role = Literal["input", "weight", "grad"]
ROLES: tuple[str, ...] = ("input", "weight", "grad")


class Scaling(enum.Enum):
    """What one scale covers: a recipe's scaling granularity (its ``Recipe.name``)."""

    TENSORWISE = "tensorwise"  # one fp32 scale per tensor (per expert, per token group)
    BLOCKWISE = "blockwise"  # fp32 scales per 1x128 block, per 128x128 tile for weights
    MXFP8 = "mxfp8"  # E8M0 scales per 1x32 block
    ROWWISE = "rowwise"  # one fp32 scale per row of each GEMM operand


RECIPE_NAMES: tuple[str, ...] = tuple(s.value for s in Scaling)
_FORMATS = ("E4M3", "HYBRID")  # TE asserts "Pure E5M2 training is not supported."
# How FP8 GEMMs accumulate (``Config.fp8_accumulate``): "te" fast for the forward GEMM and
# precise (split) for dgrad and wgrad, as TE's recipes and torchao's float8 set it; or one mode.
ACCUMULATIONS = ("te", "fast", "precise")
# A linear's three GEMMs by their operands' roles (the order ``fp8_gemm``'s ``roles`` reads).
GEMM_ROLES = {"fprop": ("input", "weight"), "dgrad": ("grad", "weight"),
              "wgrad": ("grad", "input")}
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # TE's quantizer input types
_FLT_MAX = torch.finfo(torch.float32).max
_MX_BLOCK = 32


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an fp8 dtype: 448 (E4M3), 57344 (E5M2)."""
    if dtype not in (E4M3, E5M2):
        raise ValueError(f"not an fp8 dtype: {dtype}; expected {E4M3} or {E5M2}")
    return torch.finfo(dtype).max


@dataclass(frozen=True)
class Recipe:
    """One FP8 recipe and its variant: the one identity every part of graphpass compares.

    ``name`` is the scaling granularity (``scaling``: one of ``RECIPE_NAMES``). ``fp8_format`` is
    ``"HYBRID"`` (E4M3 forward, E5M2 for ``"grad"``) or ``"E4M3"``: the fp8 dtype of each role
    (``dtype``). ``power_2_scales`` rounds tensorwise/blockwise/rowwise scales down to a power of
    two (TE's ``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES=1`` / default ``Float8BlockScaling``,
    torchao's ``round_scales_to_power_of_2``); it must be True for mxfp8, whose E8M0 scales are
    powers of two by construction. ``amax_epsilon`` is the floor TE applies to the amax
    (``QParams.amax_epsilon``); TE's MXFP8 has none. ``accumulate`` is how its GEMMs accumulate,
    per GEMM role (``accumulation``, ``fast_accumulation``; one of ``ACCUMULATIONS``). TE's
    environment overrides are not read: build a variant with
    ``dataclasses.replace(get_recipe(name), ...)``.

    Graph ops carry a recipe as its ``key`` (a custom op's schema takes strings), which
    ``get_recipe`` parses back: the name, then the variant's settings that differ from the
    name's defaults, each one word (``"tensorwise_e4m3"``, ``"blockwise_nopow2"``,
    ``"rowwise_pow2_fast"``).
    """

    name: str
    fp8_format: str
    power_2_scales: bool
    amax_epsilon: float = 0.0
    accumulate: str = "te"

    def __post_init__(self) -> None:
        if self.name not in RECIPE_NAMES:
            raise ValueError(f"unknown recipe {self.name!r}; valid recipes are: {_names()}")
        if self.fp8_format not in _FORMATS:
            raise ValueError(
                f"invalid fp8_format {self.fp8_format!r}; valid formats are: "
                + ", ".join(map(repr, _FORMATS))
            )
        if not self.amax_epsilon >= 0.0:
            raise ValueError(f"amax_epsilon must be >= 0, got {self.amax_epsilon!r}")
        if self.accumulate not in ACCUMULATIONS:
            raise ValueError(f"unknown FP8 accumulation {self.accumulate!r}; valid values are "
                             + ", ".join(map(repr, ACCUMULATIONS)))
        if self.scaling is Scaling.MXFP8 and (not self.power_2_scales or self.amax_epsilon != 0.0):
            raise ValueError(
                "mxfp8 scales are E8M0 powers of two with no amax epsilon: "
                "use power_2_scales=True, amax_epsilon=0.0"
            )
        if self.scaling is Scaling.ROWWISE and self.fp8_format != "E4M3":
            raise ValueError("rowwise scaling is E4M3 for every role (the rowwise FP8 GEMMs take "
                             "E4M3 operands only): use fp8_format='E4M3'")

    @property
    def scaling(self) -> Scaling:
        return Scaling(self.name)

    @property
    def per_tensor(self) -> bool:
        """One scale per tensor (per expert, or per token group over experts)."""
        return self.scaling is Scaling.TENSORWISE

    @property
    def per_row(self) -> bool:
        """One scale per row of each GEMM operand, of any length (no fixed block)."""
        return self.scaling is Scaling.ROWWISE

    @property
    def e8m0_scales(self) -> bool:
        """Scales stored as uint8 E8M0 exponents (mxfp8), not fp32."""
        return self.scaling is Scaling.MXFP8

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.uint8 if self.e8m0_scales else torch.float32

    @property
    def unit_scale(self) -> int:
        """The stored ``scale_inv`` of scale 1 (the E8M0 byte 127, or 1.0)."""
        return 127 if self.e8m0_scales else 1

    @property
    def whole_blocks(self) -> bool:
        """Whether ``quantize`` takes whole blocks only (mxfp8: multiples of 32); the other
        recipes pad a partial block."""
        return self.e8m0_scales

    @property
    def all_e4m3(self) -> bool:
        """E4M3 in every role (no E5M2 gradients)."""
        return self.fp8_format == "E4M3"

    def dtype(self, role: Role) -> torch.dtype:
        """The fp8 dtype of ``role``: E5M2 only for gradients under HYBRID."""
        if role not in ROLES:
            raise ValueError(f"unknown role {role!r}; valid roles are: "
                             + ", ".join(map(repr, ROLES)))
        return E5M2 if self.fp8_format == "HYBRID" and role == "grad" else E4M3

    def block(self, role: Role) -> tuple[int, int] | None:
        """(rows, cols) of one scaling block of ``role``'s quantized data; None for one scale per
        tensor. Blockwise: 128x128 for weights (``w_block_scaling_dim=2``), else 1x128; mxfp8:
        1x32. Rowwise has no fixed block (a whole row, of any length): callers ask
        ``per_row`` first, and this raises for it."""
        self.dtype(role)  # validates the role
        if self.scaling is Scaling.TENSORWISE:
            return None
        if self.scaling is Scaling.ROWWISE:
            raise ValueError("rowwise scaling has one scale per row, no fixed block: ask "
                             "is_rowwise")
        if self.scaling is Scaling.BLOCKWISE:
            return (128, 128) if role == "weight" else (1, 128)
        return (1, _MX_BLOCK)

    @property
    def multiple(self) -> int:
        """What the FP8 GEMM needs GEMM dimensions to be multiples of: 16 (tensorwise, Hopper
        leading dimensions), 128 (blockwise) or 32 (mxfp8). ``quantize`` itself enforces
        only mxfp8's; blockwise pads partial blocks. Rowwise: 16, as tensorwise (both
        ``torch._scaled_mm`` and ``torch._scaled_grouped_mm`` need K and N multiples of 16)."""
        return {Scaling.TENSORWISE: 16, Scaling.BLOCKWISE: 128, Scaling.MXFP8: _MX_BLOCK,
                Scaling.ROWWISE: 16}[self.scaling]

    def fast_accumulation(self, a_role: str, b_role: str) -> bool:
        """Whether a GEMM of these operand roles accumulates fast: under ``"te"`` the forward
        GEMM only (no gradient operand)."""
        if self.accumulate == "te":
            return "grad" not in (a_role, b_role)
        return self.accumulate == "fast"

    @property
    def accumulation(self) -> dict[str, str]:
        """``"fast"`` or ``"precise"`` for each of a linear's GEMMs (``GEMM_ROLES``)."""
        return {gemm: "fast" if self.fast_accumulation(*roles) else "precise"
                for gemm, roles in GEMM_ROLES.items()}

    def _variant(self) -> tuple[str, str]:
        """The words of the key for the format and the scales: ``""`` where the name's default."""
        default = _DEFAULTS[self.name]
        fmt = "" if self.fp8_format == default.fp8_format else self.fp8_format.lower()
        pow2 = ("" if self.power_2_scales == default.power_2_scales
                else "pow2" if self.power_2_scales else "nopow2")
        return fmt, pow2

    @property
    def key(self) -> str:
        """The one string graph ops carry for this recipe; ``get_recipe(key)`` is this recipe."""
        return "_".join(w for w in (self.quantization_key,
                                    "" if self.accumulate == "te" else self.accumulate) if w)

    @property
    def quantization_key(self) -> str:
        """The key without the accumulation: what a quantize's bits depend on."""
        if self.amax_epsilon != 0.0:
            raise ValueError(f"a recipe with amax_epsilon={self.amax_epsilon!r} has no key: "
                             "graph ops carry recipes with TE's default epsilon (0) only")
        return "_".join(w for w in (self.name, *self._variant()) if w)

    @property
    def label(self) -> str:
        """The recipe as the lowering's notes name it: the name, with a format that is not the
        name's default (``"tensorwise_e4m3"``)."""
        return "_".join(w for w in (self.name, self._variant()[0]) if w)


TENSORWISE = Recipe("tensorwise", "HYBRID", power_2_scales=False)
TENSORWISE_E4M3 = Recipe("tensorwise", "E4M3", power_2_scales=False)
BLOCKWISE = Recipe("blockwise", "E4M3", power_2_scales=True)
MXFP8 = Recipe("mxfp8", "E4M3", power_2_scales=True)
ROWWISE = Recipe("rowwise", "E4M3", power_2_scales=False)
ROWWISE_POW2 = Recipe("rowwise", "E4M3", power_2_scales=True)
BLOCKWISE_NOPOW2 = Recipe("blockwise", "E4M3", power_2_scales=False)
_DEFAULTS = {r.name: r for r in (TENSORWISE, BLOCKWISE, MXFP8, ROWWISE)}
# The variants Config's options select, by option: fp8_pow2_scales for rowwise (torchao's
# round_scales_to_power_of_2) and blockwise (TE's NVTE_FP8_BLOCK_SCALING_FP32_SCALES), fp8_format
# for tensorwise (TE's Format.E4M3; the other recipes are E4M3 in every role already).
_OPTIONS = {"fp8_pow2_scales": (Scaling.ROWWISE, Scaling.BLOCKWISE),
            "fp8_format": (Scaling.TENSORWISE,)}


def _every_recipe() -> list[Recipe]:
    """Every recipe a key names: each name in each format, scale setting and accumulation that
    the recipe takes (TE's default amax epsilon)."""
    out = []
    for name, fmt, pow2, mode in itertools.product(RECIPE_NAMES, _FORMATS, (False, True),
                                                   ACCUMULATIONS):
        try:
            out.append(Recipe(name, fmt, pow2, accumulate=mode))
        except ValueError:  # not a recipe (mxfp8 without power-of-two scales, rowwise HYBRID)
            continue
    return out


# Every key, parsed: the keys are printed by ``Recipe.key`` alone, so each parses back to its
# recipe by construction, and a lookup is all that tracing ``get_recipe`` costs.
_BY_KEY = {r.key: r for r in _every_recipe()}


def _names() -> str:
    return ", ".join(map(repr, RECIPE_NAMES))


def get_recipe(key: str) -> Recipe:
    """The recipe a key names: a name of ``RECIPE_NAMES`` (TE's default settings) or the key
    of a variant (``Recipe.key``: ``"rowwise_pow2"``, ``"blockwise_nopow2"``,
    ``"tensorwise_e4m3"``, ``"tensorwise_fast"``). The one parser of recipe keys."""
    if key == "delayed":
        raise ValueError(
            "recipe 'delayed' (TE DelayedScaling) is not supported under torch.compile: its amax "
            "history and scales are mutable state updated outside the graph, and TE itself "
            "refuses it when compiling (check_recipe_support). Use 'tensorwise' "
            "(Float8CurrentScaling), 'blockwise' (Float8BlockScaling), 'mxfp8' "
            "(MXFP8BlockScaling) or 'rowwise' (torchao's rowwise scaling) instead."
        )
    recipe = _BY_KEY.get(key) if isinstance(key, str) else None
    if recipe is None:
        raise ValueError(f"unknown recipe {key!r}; valid recipes are: {_names()} (a graph op's "
                         "key adds the words of its variant: Recipe.key)")
    return recipe


def takes_option(name: str | None, option: str) -> bool:
    """Whether ``Config(fp8=name)`` has a variant that ``option`` selects (``"fp8_pow2_scales"``
    for rowwise and blockwise, ``"fp8_format"`` for tensorwise)."""
    return name in RECIPE_NAMES and Scaling(name) in _OPTIONS[option]


@functools.lru_cache(maxsize=None)
def from_options(fp8: str | None, fp8_format: str = "hybrid", fp8_pow2_scales: bool | None = None,
                 fp8_accumulate: str = "te") -> Recipe | None:
    """The recipe of ``Config(fp8=..., fp8_format=..., fp8_pow2_scales=...,
    fp8_accumulate=...)`` (None: FP8 off): the one function from the user's options to a
    Recipe. ``fp8_pow2_scales=None`` is the recipe's default; ``fp8_format`` (``"hybrid"`` or
    ``"e4m3"``) and ``fp8_pow2_scales`` set only where ``takes_option`` says so."""
    if fp8 is None:
        return None
    if fp8 not in RECIPE_NAMES:
        get_recipe(fp8)  # "delayed" says why not
        raise ValueError(f"unknown recipe {fp8!r}; valid recipes are: {_names()}")
    recipe = dataclasses.replace(_DEFAULTS[fp8], accumulate=fp8_accumulate)
    if fp8_format != "hybrid":
        if not takes_option(fp8, "fp8_format"):
            raise ValueError(f"fp8_format={fp8_format!r} is an option of "
                             f"{_option_recipes('fp8_format')}, not {fp8!r}")
        recipe = dataclasses.replace(recipe, fp8_format=fp8_format.upper())
    if fp8_pow2_scales is not None:
        if not takes_option(fp8, "fp8_pow2_scales"):
            raise ValueError(f"power-of-two scales are an option of "
                             f"{_option_recipes('fp8_pow2_scales')}, not {fp8!r}")
        recipe = dataclasses.replace(recipe, power_2_scales=fp8_pow2_scales)
    return recipe


def _option_recipes(option: str) -> str:
    return " and ".join(f"fp8={s.value!r}" for s in _OPTIONS[option])


def as_recipe(recipe: Recipe | str) -> Recipe:
    """``recipe``, or the recipe its key names."""
    return get_recipe(recipe) if isinstance(recipe, str) else recipe



def is_tensorwise(recipe: Recipe | str) -> bool:
    """One scale per tensor (per expert or token group over experts): ``"tensorwise"`` and its
    variants."""
    return as_recipe(recipe).per_tensor


def is_rowwise(recipe: Recipe | str) -> bool:
    """One scale per row of each GEMM operand (``"rowwise"``, ``"rowwise_pow2"``)."""
    return as_recipe(recipe).per_row


def fp8_dtype(recipe: Recipe | str, role: Role) -> torch.dtype:
    """The fp8 dtype of ``role`` under ``recipe``: E5M2 only for gradients under HYBRID."""
    return as_recipe(recipe).dtype(role)


def block_shape(recipe: Recipe | str, role: Role) -> tuple[int, int] | None:
    """``Recipe.block``: (rows, cols) of one scaling block; None for one scale per tensor."""
    return as_recipe(recipe).block(role)


def requires_divisibility(recipe: Recipe | str) -> int:
    """``Recipe.multiple``: what the FP8 GEMM needs GEMM dimensions to be multiples of."""
    return as_recipe(recipe).multiple


def compute_scale_from_amax(
    amax: torch.Tensor,
    max_fp8: float,
    *,
    power_2_scales: bool = False,
    amax_epsilon: float = 0.0,
    value_for_inf: float = _FLT_MAX,
) -> torch.Tensor:
    """TE's ``compute_scale_from_amax`` (recipe_common.cuh), elementwise on fp32 ``amax``.

    The amax is floored at ``amax_epsilon``; an amax of 0, inf or NaN gives scale 1; otherwise
    ``max_fp8 / amax`` (IEEE fp32 division), with an overflow to inf replaced by ``value_for_inf``
    (FLT_MAX for tensorwise, the input dtype's max for blockwise), and with power-of-2 scaling the
    mantissa bits cleared, i.e. rounded down to a power of two.
    """
    amax = amax.to(torch.float32)
    amax = torch.where(amax < amax_epsilon, amax_epsilon, amax)  # NaN < eps is False: kept
    # Tensor / tensor: ``float / tensor`` is ``reciprocal() * float`` in torch, rounding twice.
    scale = torch.full_like(amax, max_fp8) / amax
    scale = torch.where(torch.isinf(scale), value_for_inf, scale)
    if power_2_scales:
        # Keep sign and exponent (mask 0xFF800000); scale > 0 here, so never zero or subnormal.
        scale = (scale.view(torch.int32) & -0x800000).view(torch.float32)
    degenerate = (amax == 0) | ~torch.isfinite(amax)
    return torch.where(degenerate, 1.0, scale)


def reciprocal(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` by IEEE fp32 division, as ``torch.reciprocal`` computes it in eager, and under
    Inductor too: Inductor lowers ``reciprocal`` to a division of the int32 constant 1, which
    its exact-division setting (``eager_numerics.division_rounding``, fp32 over fp32 only) does
    not reach, so Triton's approximate ``div.full`` gave scale_inv an ulp off eager's (an H200,
    torch 2.11: rowwise scales of large amaxes)."""
    return torch.full_like(scale, 1.0) / scale


def float_to_e8m0(val: torch.Tensor) -> torch.Tensor:
    """TE's ``float_to_e8m0`` (ptx_arch_spec.cuh) of fp32 ``val >= 0``, as uint8.

    The fp32 exponent, incremented when the mantissa is non-zero (rounding the power of two up),
    saturating at 254 (2**127); 0 -> 0 and subnormals up to 2**-127 -> 0, inf -> 254, NaN -> 255.
    """
    bits = val.to(torch.float32).view(torch.int32)
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    round_up = (mantissa > 0) & (exponent != 0xFE) & ~((exponent == 0) & (mantissa <= 0x400000))
    e = exponent + round_up.to(torch.int32)
    e = torch.where(torch.isinf(val), 0xFE, e)
    e = torch.where(torch.isnan(val), 0xFF, e)
    return e.to(torch.uint8)


def _e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """2**(e - 127) in fp32 for int32 ``e``; 0 -> 2**-127 (subnormal), 255 -> NaN (TE ``exp2f``)."""
    bits = torch.where(e == 0, 0x00400000, torch.where(e == 0xFF, 0x7FFFFFFF, e << 23))
    return bits.view(torch.float32)


def e8m0_to_float(e: torch.Tensor) -> torch.Tensor:
    """The fp32 value ``2**(e - 127)`` of uint8 E8M0 bytes (``float_to_e8m0``'s inverse on
    powers of two)."""
    return _e8m0_to_float(e.to(torch.int32))


def _e8m0_reciprocal(e: torch.Tensor) -> torch.Tensor:
    """2**(127 - e), the quantization multiplier (TE ``exp2f_rcp``); 255 -> NaN."""
    return _e8m0_to_float(torch.where(e == 0xFF, 0xFF, 254 - e))


def _f32(value: float) -> float:
    """``value`` rounded to fp32 (as a C++ ``constexpr float`` initializer does)."""
    return struct.unpack("f", struct.pack("f", value))[0]


# TE multiplies the block amax by the fp32-rounded reciprocal of fp8_max (Quantized_Limits::
# max_norm_rcp) instead of dividing by fp8_max; doing the same matches its bits by construction.
_MAX_NORM_RCP = {dtype: _f32(1.0 / fp8_max(dtype)) for dtype in (E4M3, E5M2)}


def _maybe_nonempty(x: torch.Tensor) -> bool:
    """False for an empty ``x``; True for a non-empty one, or one of unknown (unbacked) size."""
    from torch.fx.experimental.symbolic_shapes import guard_or_true

    return guard_or_true(x.numel() != 0)


def _abs_amax(x: torch.Tensor, dim: tuple[int, ...]) -> torch.Tensor:
    a = x.abs()
    return torch.where(torch.isnan(a), 0.0, a).amax(dim=dim)  # NaN-ignoring, like fmaxf


def _saturating_cast(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """RNE cast with satfinite; clamp keeps NaN as NaN."""
    m = fp8_max(dtype)
    return y.clamp(-m, m).to(dtype)


def _tiles(x: torch.Tensor, bm: int, bk: int) -> torch.Tensor:
    """``x`` zero-padded to whole tiles, viewed as (rows/bm, bm, cols/bk, bk)."""
    m, k = x.shape
    mb, kb = -(-m // bm), -(-k // bk)
    return F.pad(x, (0, kb * bk - k, 0, mb * bm - m)).reshape(mb, bm, kb, bk)


def _untile(t: torch.Tensor, m: int, k: int) -> torch.Tensor:
    mb, bm, kb, bk = t.shape
    return t.reshape(mb * bm, kb * bk)[:m, :k]


def tensorwise_scale(amax: torch.Tensor, recipe: Recipe | str, role: Role) -> torch.Tensor:
    """The tensorwise scale of fp32 ``amax`` (elementwise: one amax per tensor, or per expert or
    token group where ``amax`` holds several)."""
    recipe = as_recipe(recipe)
    return compute_scale_from_amax(amax, fp8_max(fp8_dtype(recipe, role)),
                                   power_2_scales=recipe.power_2_scales,
                                   amax_epsilon=recipe.amax_epsilon)


def blockwise_scale(amax: torch.Tensor, recipe: Recipe | str, role: Role,
                    input_dtype: torch.dtype) -> torch.Tensor:
    """The blockwise scales of fp32 block amaxes ``amax`` (elementwise), an overflow to inf
    replaced by ``input_dtype``'s largest value (TE's ``compute_scale_from_types<IType, OType>``)."""
    recipe = as_recipe(recipe)
    return compute_scale_from_amax(amax, fp8_max(fp8_dtype(recipe, role)),
                                   power_2_scales=recipe.power_2_scales,
                                   amax_epsilon=recipe.amax_epsilon,
                                   value_for_inf=torch.finfo(input_dtype).max)


def scaled_cast(x32: torch.Tensor, scale: torch.Tensor, recipe: Recipe | str,
                role: Role) -> torch.Tensor:
    """Tensorwise FP8 data of fp32 ``x32``: ``fp8(x32 * scale)``, saturating, with ``scale``
    broadcast. Elementwise, so parts scaled by their own scales in one call get the bits of each
    part quantized alone."""
    return _saturating_cast(x32 * scale, fp8_dtype(recipe, role))


def row_scale(x32: torch.Tensor, recipe: Recipe | str, role: Role) -> torch.Tensor:
    """The rowwise scales of fp32 ``x32`` (any number of leading dimensions): one per row along
    the last dimension, shape ``(..., rows, 1)``; NaN ignored, an all-zero row gets 1."""
    recipe = as_recipe(recipe)
    amax = _abs_amax(x32, (-1,))[..., None] if x32.shape[-1] else x32.new_zeros(
        (*x32.shape[:-1], 1))
    return compute_scale_from_amax(amax, fp8_max(fp8_dtype(recipe, role)),
                                   power_2_scales=recipe.power_2_scales,
                                   amax_epsilon=recipe.amax_epsilon)


def rowwise_quantize(x32: torch.Tensor, recipe: Recipe | str,
                     role: Role) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise FP8 data of fp32 ``x32`` (``(..., R, C)``, scales along C): ``(data, scale_inv)``,
    data contiguous, scale_inv fp32 ``(..., R, 1)``. Every row on its own: a stack of matrices
    quantized at once is bit-identical to each quantized alone."""
    scale = row_scale(x32, recipe, role)
    return scaled_cast(x32, scale, recipe, role).contiguous(), reciprocal(scale)


def tensor_amax(x: torch.Tensor) -> torch.Tensor:
    """The fp32 amax of a whole tensor, NaN ignored, 0 for an empty one: what tensorwise scaling
    reads. The max of the amaxes of a tensor's parts is the amax of the whole, exactly (max is
    exact and order-free), so parts quantized with ``quantize(part, ..., amax=that max)`` are
    bit-identical to the whole quantized at once (TE's amax reduction over a group)."""
    x32 = x.to(torch.float32)
    return _abs_amax(x32, tuple(range(x32.dim()))) if x32.numel() else x32.new_zeros(())


def quantize(
    x: torch.Tensor,
    recipe: Recipe | str,
    role: Role,
    *,
    columnwise: bool = False,
    amax: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a 2-D fp32/bf16/fp16 ``x`` of shape (M, K) as TE does; returns (data, scale_inv).

    ``columnwise=False``: data (M, K), blocks along K. ``columnwise=True``: the quantization of
    ``x.t()``, data (K, M), blocks along M. Scale shapes and dtypes: see the module docstring.
    All arithmetic is fp32 on the upcast input, as in TE's kernels (``q = fp8(x·scale)``,
    ``scale_inv = 1/scale``; mxfp8: ``q = fp8(x·2**(127-e))``).

    ``amax`` (tensorwise only): the fp32 amax to scale by instead of ``x``'s own, e.g. the max
    over a process group of each rank's ``tensor_amax`` (TE's ``with_amax_reduction``).
    """
    recipe = as_recipe(recipe)
    dtype = fp8_dtype(recipe, role)
    if x.dim() != 2:
        raise ValueError(f"quantize expects a 2-D tensor, got shape {tuple(x.shape)}")
    if x.dtype not in _INPUT_DTYPES:
        raise ValueError(f"quantize expects float32, bfloat16 or float16 input, got {x.dtype}")
    if recipe.whole_blocks and (x.shape[0] % _MX_BLOCK or x.shape[1] % _MX_BLOCK):
        raise ValueError(
            f"mxfp8 needs both dimensions to be multiples of {_MX_BLOCK}, got shape "
            f"{tuple(x.shape)}"
        )
    x32 = (x.t() if columnwise else x).to(torch.float32)
    m, k = x32.shape
    if recipe.per_row:
        if amax is not None:
            raise ValueError("a given amax scales one whole tensor: tensorwise only, not rowwise")
        return rowwise_quantize(x32, recipe, role)
    block = block_shape(recipe, role)

    if amax is not None and block is not None:
        raise ValueError(f"a given amax scales one whole tensor: tensorwise only, not {recipe.name}")
    if block is None:
        # amax() rejects empty tensors; TE's amax kernel starts from 0. Traced with a dynamic
        # size (an expert's tokens: nonzero's unbacked count), the traced graph takes amax()'s
        # branch: the same shapes, and the op decides again on real sizes when it runs.
        if amax is None:
            amax = _abs_amax(x32, (0, 1)) if _maybe_nonempty(x32) else x32.new_zeros(())
        scale = tensorwise_scale(amax, recipe, role)
        return scaled_cast(x32, scale, recipe, role).contiguous(), reciprocal(scale)

    tiles = _tiles(x32, *block)
    amax = _abs_amax(tiles, (1, 3))
    if recipe.scaling is Scaling.BLOCKWISE:
        scale = blockwise_scale(amax, recipe, role, x.dtype)
        scale_inv = reciprocal(scale)
    else:
        scale_inv = float_to_e8m0(amax * _MAX_NORM_RCP[dtype])
        scale = _e8m0_reciprocal(scale_inv.to(torch.int32))
    data = _untile(_saturating_cast(tiles * scale[:, None, :, None], dtype), m, k)
    return data.contiguous(), scale_inv


def dequantize(
    data: torch.Tensor,
    scale_inv: torch.Tensor,
    recipe: Recipe | str,
    role: Role,
    *,
    columnwise: bool = False,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Inverse of ``quantize``: ``data * scale_inv`` in fp32, cast to ``dtype`` (TE dequantize).

    Returns the tensor in the ORIGINAL (M, K) orientation: a columnwise pair, whose data is
    (K, M), comes back transposed.
    """
    recipe = as_recipe(recipe)
    expected = fp8_dtype(recipe, role)
    if data.dtype != expected or data.dim() != 2:
        raise ValueError(
            f"{recipe.name} {role} data must be a 2-D {expected} tensor, got {data.dtype} "
            f"of shape {tuple(data.shape)}"
        )
    d32 = data.to(torch.float32)
    m, k = d32.shape
    if recipe.per_row:
        if tuple(scale_inv.shape) != (m, 1):
            raise ValueError(f"rowwise {role} scale_inv for data of shape {(m, k)} must have "
                             f"shape {(m, 1)}, got {tuple(scale_inv.shape)}")
        out = (d32 * scale_inv).to(dtype)
        return out.t() if columnwise else out
    block = block_shape(recipe, role)
    if block is None:
        valid_shapes: tuple[tuple[int, ...], ...] = ((), (1,))  # (1,) is TE's own layout
    else:
        valid_shapes = ((-(-m // block[0]), -(-k // block[1])),)
    if tuple(scale_inv.shape) not in valid_shapes:
        raise ValueError(
            f"{recipe.name} {role} scale_inv for data of shape {(m, k)} must have shape "
            f"{' or '.join(map(str, valid_shapes))}, got {tuple(scale_inv.shape)}"
        )
    if block is None:
        out = d32 * scale_inv
    else:
        s = scale_inv
        if recipe.e8m0_scales:
            s = _e8m0_to_float(s.to(torch.int32))
        out = _untile(_tiles(d32, *block) * s[:, None, :, None], m, k)
    out = out.to(dtype)
    return out.t() if columnwise else out


def qdq(
    x: torch.Tensor,
    recipe: Recipe | str,
    role: Role,
    *,
    columnwise: bool = False,
) -> torch.Tensor:
    """``dequantize(quantize(x))`` in ``x``'s shape and dtype: the values an FP8 GEMM sees."""
    data, scale_inv = quantize(x, recipe, role, columnwise=columnwise)
    return dequantize(data, scale_inv, recipe, role, columnwise=columnwise, dtype=x.dtype)
