"""FLOPs of joint-graph nodes, for the recompute budget: torch's formulas, else one per element."""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from .._compat import size_hint


aten = torch.ops.aten
# torch has formulas for the CUDA flash/efficient attention ops; the CPU flash op (what
# graphpass.plan traces on fake CPU tensors) takes the same leading arguments.
_ALIASES = {
    aten._scaled_dot_product_flash_attention_for_cpu: aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_flash_attention_for_cpu_backward:
        aten._scaled_dot_product_flash_attention_backward,
}


def step_flops(gm: fx.GraphModule) -> int:
    """FLOPs of one training step: every node of the joint forward+backward graph."""
    return sum(node_flops(n) for n in gm.graph.nodes)


def node_flops(node: fx.Node) -> int:
    if node.op != "call_function":
        return 0
    target, args = node.target, node.args
    if isinstance(target, torch._ops.HigherOrderOperator) and "rng_state" in target.name():
        # run_with_rng_state(rng_state, op, *args): the op recomputed under a saved RNG state
        target, args = next(((a, args[i + 1:]) for i, a in enumerate(args)
                             if isinstance(a, torch._ops.OpOverload)), (None, ()))
    if not isinstance(target, torch._ops.OpOverload):
        return 0
    packet = target.overloadpacket
    formula = flop_registry.get(_ALIASES.get(packet, packet))
    val = node.meta.get("val")
    if formula is not None:
        args = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in args]
        kwargs = {k: (v.meta.get("val") if isinstance(v, fx.Node) else v) for k, v in node.kwargs.items()}
        try:
            return size_hint(formula(*args, **kwargs, out_val=val))
        except Exception:  # a formula that cannot read symbolic shapes: fall back to elements
            pass
    vals = val if isinstance(val, (list, tuple)) else [val]
    return sum(size_hint(v.numel()) for v in vals if isinstance(v, torch.Tensor))
