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
inlined too. Block recipes run on the reference provider (an emulation) and stay one op.

Exactness: in a fused kernel Inductor keeps bf16 intermediates in fp32 unless
``emulate_precision_casts`` is set, so a fused quantize would see an unrounded input and give
other FP8 bits than the op (and than a re-quantize of the saved original in the backward). The
backend sets it whenever it inlines, so the bits stay the op's
(``tests/test_fp8_lowering.py::test_inlined_quantize_is_bit_identical_to_the_op``).
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


def inlinable(recipe: str, role: str, device: torch.device) -> bool:
    """Whether a quantize is inlined: tensorwise only, and on CUDA not for gradients. On an H100
    (torch 2.11) a gradient quantize fused with its producers in the backward gave other FP8 bits
    than the op, although the same quantize compiled on its own is exact; with gradient
    quantizes kept as one op, the whole step is bit-identical (forward quantizes fuse exactly)."""
    return (recipes.get_recipe(recipe).name in INLINED_RECIPES
            and (device.type == "cpu" or role != "grad"))


def fusion_notes(*, device_types: set[str]) -> list[Decision]:
    """The report's decisions for the quantizes ``fuse_quantize`` leaves as one op on these
    devices."""
    if not _compat.inductor_rounds_fused_casts(device_types=device_types):
        return [Decision(What.FUSE_QUANTIZE_OFF, "fuse_quantize", (
            f"torch {_compat.TORCH_VERSION_STR}'s Inductor CPU code does not round fused bf16 "
            "values as eager does, so fused quantizes would not give the recipe's FP8 bits; each "
            "quantize runs as one op (torch >= 2.13 fuses them)"))]
    if "cuda" in device_types:
        return [Decision(What.FUSE_QUANTIZE_PARTLY, "fuse_quantize", (
            "gradient quantizes run as one op on CUDA: fused with their producers in the "
            "backward they gave other FP8 bits than the op (H100, torch 2.11); forward quantizes "
            "are fused"))]
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
            match.kwargs["recipe"], match.kwargs["role"], match.kwargs["x"].meta["val"].device),
        pass_dict=patterns,
    )
    def _inline(match: Any, x: fx.Node, recipe: str, role: str, usage: str) -> None:
        match.replace_by_example(lambda x: ops._quantize(x, recipe, role, usage), [x])

    @pm.register_graph_pattern(
        pm.CallFunction(ops.QUANTIZE, pm.KeywordArg("x"), pm.KeywordArg("recipe"),
                        pm.KeywordArg("role"), pm.KeywordArg("usage"), pm.KeywordArg("offs")),
        # rowwise over token groups: per-row or per-(group, column) scales, no host sync
        extra_check=lambda match: recipes.is_rowwise(match.kwargs["recipe"]) and inlinable(
            match.kwargs["recipe"], match.kwargs["role"], match.kwargs["x"].meta["val"].device),
        pass_dict=patterns,
    )
    def _inline_groups(match: Any, x: fx.Node, recipe: str, role: str, usage: str,
                       offs: fx.Node) -> None:
        match.replace_by_example(lambda x, offs: ops._quantize(x, recipe, role, usage, offs),
                                 [x, offs])

    return patterns


def inline_quantizes(graph: fx.Graph) -> int:
    """Replace every tensorwise ``graphpass::quantize`` in ``graph`` by its recipe's ops."""
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
