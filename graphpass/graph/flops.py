"""FLOPs of joint-graph nodes, for the recompute budget: torch's formulas, else one per element.

Ops without a formula (pointwise ops, reductions, copies) count one FLOP per output element, the
model of the recompute budget. An op whose formula cannot read its shapes (symbolic sizes, shapes
the formula rejects) is estimated the same way: pass ``estimated`` (a dict) to learn which ops
were and why (``{"aten.mm": "its FLOP formula failed: ..."}``), for the report.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

from .. import _compat
from .._compat import flop_formula, size_hint


aten = torch.ops.aten
# torch has formulas for the CUDA flash/efficient attention ops; the CPU flash op (what
# graphpass.plan traces on fake CPU tensors) takes the same leading arguments.
_ALIASES = {
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward:
        aten._scaled_dot_product_flash_attention_backward,
}


def step_flops(gm: fx.GraphModule, estimated: dict[str, str] | None = None) -> int:
    """FLOPs of one training step: every node of the joint forward+backward graph."""
    return sum(node_flops(n, estimated) for n in gm.graph.nodes)


def node_flops(node: fx.Node, estimated: dict[str, str] | None = None) -> int:
    if node.op != "call_function":
        return 0
    target, args = node.target, node.args
    if _compat.is_higher_order(target) and "rng_state" in target.name():
        # run_with_rng_state(rng_state, op, *args): the op recomputed under a saved RNG state
        target, args = next(((a, args[i + 1:]) for i, a in enumerate(args)
                             if _compat.is_op_overload(a)), (None, ()))
    if not _compat.is_op_overload(target):
        return 0
    packet = target.overloadpacket
    formula = flop_formula(_ALIASES.get(packet, packet))
    val = node.meta.get("val")
    name = str(packet).replace("::", ".")
    where = f"the FLOPs of {node.name} ({name})"
    if formula is not None:
        args = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in args]
        kwargs = {k: (v.meta.get("val") if isinstance(v, fx.Node) else v) for k, v in node.kwargs.items()}
        try:
            return size_hint(formula(*args, **kwargs, out_val=val), where=where)
        except (GuardOnDataDependentSymNode, TypeError, ValueError, AssertionError) as e:
            # torch's formulas are written for concrete shapes: a data-dependent size they
            # cannot compare, or shapes they reject (AssertionError)
            reason = f"its FLOP formula failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
        if estimated is not None:
            estimated.setdefault(name, reason)
    vals = val if isinstance(val, (list, tuple)) else [val]
    return sum(size_hint(v.numel(), where=where) for v in vals if isinstance(v, torch.Tensor))
