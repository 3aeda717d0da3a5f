"""Inductor code generation for ``graphpass::quantize``: the recipe inlined after the partition.

The partition needs each quantize as one op: its 1-byte outputs are values the min-cut can save,
recompute or offload. Once the forward and backward graphs are fixed, an opaque op only costs:
Inductor runs it as an extern call on materialized inputs (an amax pass, a scale, a cast, each
its own kernel). Inlining the recipe's arithmetic into the partitioned graphs (a post-grad pass,
before Inductor's own pattern passes) lets Inductor fuse the amax reduction, the scale and the
saturating cast, and the transpose of a columnwise copy, with the ops around them, as it does
for torchao's float8.

The tensorwise and rowwise recipes are inlined: they are the ones the TE and ``torch._scaled_mm``
/ ``torch._scaled_grouped_mm`` GEMMs take. A rowwise scale is local to its row (one reduction
along it), and its grouped quantizes (offsets) are device ops without a host sync, so they are
inlined too. Block recipes' quantizes stay one op.

Numerics. Fusing is a speed decision, held to a bound, not to the opaque op's bits: each
dequantized FP8 value of a fused quantize is within one FP8 ulp of the opaque op's (the bound the
tests assert, ``tests/test_fp8_lowering.py``). Where Inductor can cheaply read the value eager
reads, the bits are the op's as well: in a fused kernel it keeps bf16 intermediates in fp32
unless ``emulate_precision_casts`` is set, so the backend sets it (a rounding in registers, no
extra memory traffic) together with exact fp32 division (``eager_numerics.division_rounding``:
the scale ``fmax / amax``). On the CPU that makes fused and opaque bit-identical
(``test_inlined_quantize_is_bit_identical_to_the_op``); on an H100 (torch 2.11) gradient
quantizes fused with their producers in the backward gave other bits than the op, which the
bound covers. Every quantize is inlined on every device, gradients included: an opaque gradient
quantize ran five or six eager kernels with fp32 temporaries of the whole gradient (the FP8 step
was 0.63x bf16's). ``fuse_quantize=False`` keeps each one opaque, for debugging.
"""

from __future__ import annotations

import functools
import hashlib
from typing import Any

import torch
import torch.fx as fx

from .. import _compat
from ..decisions import Decision, What
from . import ops, recipes

INLINED_RECIPES = ("tensorwise", "rowwise")


def inlinable(recipe: str) -> bool:
    """Whether a quantize is inlined: every tensorwise and rowwise one, on every device and in
    every role."""
    return recipes.get_recipe(recipe).name in INLINED_RECIPES


def fusion_notes(*, device_types: set[str]) -> list[Decision]:
    """The report's decisions for the quantizes ``fuse_quantize`` leaves as one op on these
    devices."""
    if not _compat.inductor_rounds_fused_casts(device_types=device_types):
        return [Decision(What.FUSE_QUANTIZE_OFF, "fuse_quantize", (
            f"torch {_compat.TORCH_VERSION_STR}'s Inductor CPU code does not round fused bf16 "
            "values as eager does, so fused quantizes would not give the recipe's FP8 bits; each "
            "quantize runs as one op (torch >= 2.13 fuses them)"))]
    return []


@functools.lru_cache(maxsize=1)
def _patterns() -> Any:
    """The pattern pass, built on first use (importing Inductor's pattern matcher is slow)."""
    pm = _compat.inductor_pattern_matcher()
    patterns = pm.PatternMatcherPass(pass_name="graphpass_inline_quantize")

    @pm.register_graph_pattern(
        pm.CallFunction(ops.QUANTIZE, pm.KeywordArg("x"), pm.KeywordArg("recipe"),
                        pm.KeywordArg("role"), pm.KeywordArg("usage")),
        # a grouped quantize (offsets: one scale per token group) stays one op
        extra_check=lambda match: len(match.output_node().args) == 4 and inlinable(
            match.kwargs["recipe"]),
        pass_dict=patterns,
    )
    def _inline(match: Any, x: fx.Node, recipe: str, role: str, usage: str) -> None:
        match.replace_by_example(lambda x: fused_quantize(x, recipe, role, usage), [x])

    @pm.register_graph_pattern(
        pm.CallFunction(ops.QUANTIZE, pm.KeywordArg("x"), pm.KeywordArg("recipe"),
                        pm.KeywordArg("role"), pm.KeywordArg("usage"), pm.KeywordArg("offs")),
        # rowwise over token groups: per-row or per-(group, column) scales, no host sync
        extra_check=lambda match: recipes.is_rowwise(match.kwargs["recipe"]) and inlinable(
            match.kwargs["recipe"]),
        pass_dict=patterns,
    )
    def _inline_groups(match: Any, x: fx.Node, recipe: str, role: str, usage: str,
                       offs: fx.Node) -> None:
        match.replace_by_example(lambda x, offs: ops._quantize(x, recipe, role, usage, offs),
                                 [x, offs])

    return patterns


def fused_quantize(x: torch.Tensor, recipe: str, role: str, usage: str) -> list[torch.Tensor]:
    """``graphpass::quantize``'s outputs, written for fusion: the same bits as the op's recipe
    (``ops._quantize``), with no fp32 value that two loops read. The recipe reads one fp32 copy
    of ``x`` twice (the amax, then the cast), and Inductor may realize a value that two loops
    read: a whole fp32 temporary (measured on the CPU: fp32 buffers of the SwiGLU output and of
    a columnwise input's transpose in the tiny Llama's step). Here the amax reduces ``x`` in its
    own dtype (abs and max are exact, so the fp32 of that max is the fp32 amax), and each copy
    casts ``x`` to fp32 on its own, inside its cast loop; a ``both`` quantize shares one amax and
    one scale (the columnwise copy is the rowwise one transposed, bit for bit)."""
    if (x.dim() != 2 or recipes.is_rowwise(recipe)
            or recipes.block_shape(recipe, role) is not None):
        return ops._quantize(x, recipe, role, usage)  # the recipe as the op runs it
    amax = recipes._abs_amax(x, (0, 1)).to(torch.float32) if recipes._maybe_nonempty(x) else (
        x.new_zeros((), dtype=torch.float32))
    scale = recipes.tensorwise_scale(amax, recipe, role)
    scale_inv = torch.reciprocal(scale)
    out: list[torch.Tensor] = []
    for columnwise in ops._COLUMNWISE[usage]:
        data = recipes.scaled_cast((x.t() if columnwise else x).to(torch.float32), scale, recipe,
                                   role).contiguous()
        out += [data, scale_inv.clone() if out else scale_inv]
    return out


def inline_quantizes(graph: fx.Graph) -> int:
    """Replace every tensorwise and rowwise ``graphpass::quantize`` in ``graph`` by its recipe's ops."""
    return _patterns().apply(graph)


def post_grad_pass(source_hash: str, user_pass: Any) -> Any:
    """An Inductor ``post_grad_custom_pre_pass`` that inlines quantizes after ``user_pass`` (the
    one already configured, if any: a pass or a list of them, kept and run first)."""
    user_passes = [] if user_pass is None else (
        list(user_pass) if isinstance(user_pass, (list, tuple)) else [user_pass])

    class InlineQuantize(_compat.custom_graph_pass_base()):  # type: ignore[misc]
        def __call__(self, graph: fx.Graph) -> None:
            for p in user_passes:
                p(graph)
            inline_quantizes(graph)

        def uuid(self) -> str:
            parts = [source_hash] + [str(p.uuid()) if hasattr(p, "uuid") else repr(p)
                                     for p in user_passes]
            return hashlib.sha256("|".join(parts).encode()).hexdigest()

    return InlineQuantize()
