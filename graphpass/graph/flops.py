"""FLOPs of joint-graph nodes, for the recompute budget: torch's formulas, else one per element."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from .._compat import size_hint


def node_flops(node: fx.Node) -> int:
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return 0
    formula = flop_registry.get(node.target.overloadpacket)
    val = node.meta.get("val")
    if formula is not None:
        args = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in node.args]
        kwargs = {k: (v.meta.get("val") if isinstance(v, fx.Node) else v) for k, v in node.kwargs.items()}
        try:
            return size_hint(formula(*args, **kwargs, out_val=val))
        except Exception:  # a formula that cannot read symbolic shapes: fall back to elements
            pass
    vals = val if isinstance(val, (list, tuple)) else [val]
    return sum(size_hint(v.numel()) for v in vals if isinstance(v, torch.Tensor))
