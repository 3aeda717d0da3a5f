"""Every GEMM of a joint graph: which step it is (forward, dgrad, wgrad), whether it runs in FP8,
and if not, why. This is what makes FP8 coverage a number in the report and what guarantees that
no high-precision GEMM goes unmentioned when ``fp8`` is on.

A GEMM runs in FP8 when it is a ``graphpass::fp8_gemm`` (our lowering) or one of torch's scaled
GEMMs the model calls itself. Any other GEMM-like op keeps its input precision; its reason is the
one the FP8 lowering recorded on the node (``NodeFacts.not_lowered``, e.g. an excluded or
misaligned linear), or else the form of the GEMM, read from its operands.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry, register_flop_formula

from .. import _compat
from ..decisions import facts
from ..report.coverage import PHASES, with_share
from .flops import node_flops
from .joint import gradients, primals as primals_of
from .nodes import is_backward, module_path, op_name
from .ops import FP8_GEMMS, GATHERS, GEMM_OPS, LIBRARY_GEMMS, PASS_THROUGH, SCATTERS

_ROLES_PHASE = {"input,weight": "forward", "grad,weight": "dgrad", "grad,input": "wgrad",
                "input,grad": "wgrad"}


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    # 2-D x 2-D with offsets splits the contraction dimension (the grouped wgrad: (K, T) x (T, N)
    # -> (G, K, N)), so its FLOPs are those of one (K, T) x (T, N) product; every other form
    # contracts over a_shape[-1] once per output element.
    if len(a_shape) == 2 and len(b_shape) == 2:
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    out = 1
    for size in out_shape:
        out *= size
    return 2 * out * a_shape[-1]


# torch (2.11 to 2.14.1) has no FLOP formula for grouped GEMMs; without one a grouped GEMM would
# be costed as one FLOP per output element by the planner and the recompute budget.
for _op in (torch.ops.aten._grouped_mm, torch.ops.aten._scaled_grouped_mm):
    if _op not in flop_registry:
        if _op is torch.ops.aten._grouped_mm:
            register_flop_formula(_op)(_grouped_mm_flops)
        else:  # (mat_a, mat_b, scale_a, scale_b, offs, ...): same shapes as _grouped_mm
            register_flop_formula(_op)(
                lambda a_shape, b_shape, *args, out_shape=None, **kw:
                _grouped_mm_flops(a_shape, b_shape, out_shape=out_shape))


@dataclass(frozen=True)
class Gemm:
    node: fx.Node
    module: str
    phase: str
    """``forward``, ``dgrad`` (gradient of an activation) or ``wgrad`` (of a weight)."""
    flops: int
    reason: str | None
    """None when the GEMM runs in FP8, else why it stays in high precision."""


def is_gemm(node: fx.Node) -> bool:
    return node.op == "call_function" and op_name(node) in GEMM_OPS


def gemms(joint: fx.GraphModule) -> list[Gemm]:
    """Every GEMM-like node of a joint forward+backward graph, in graph order."""
    wgrads = _weight_gradient_gemms(joint)
    forward_reason: dict[object, str] = {}
    out = []
    for node in joint.graph.nodes:
        if not is_gemm(node):
            continue
        name = op_name(node)
        if name in LIBRARY_GEMMS:
            a, b = (t.meta["val"] for t in node.args[:2])
            flops = _grouped_mm_flops(a.shape, b.shape, out_shape=(*a.shape[:-1], b.shape[-1]))
            op = name.removesuffix('_backward').replace('.', '::')  # one reason for both
            reason = f"grouped GEMM ({op}, a custom op) is not lowered to FP8"
            out += [Gemm(node, module_path(node), phase, flops, reason)
                    for phase in LIBRARY_GEMMS[name]]
            continue
        if name == "graphpass.fp8_gemm":
            phase = _ROLES_PHASE.get(node.args[5], "forward")
        elif not is_backward(node):
            phase = "forward"
        else:
            phase = "wgrad" if node in wgrads else "dgrad"
        reason = None
        if name not in FP8_GEMMS:
            if facts(node).not_lowered:
                reason = facts(node).not_lowered
            elif phase == "forward":
                reason = _form(node)
            else:  # a backward GEMM shares its forward GEMM's sequence number
                reason = forward_reason.get(node.meta.get("seq_nr"), _form(node))
            if phase == "forward" and "seq_nr" in node.meta:
                forward_reason[node.meta["seq_nr"]] = reason
        flops = _grouped_wgrad_flops(node) if name == "graphpass.fp8_gemm" else None
        out.append(Gemm(node, module_path(node), phase,
                        node_flops(node) if flops is None else flops, reason))
    return out


def _grouped_wgrad_flops(node: fx.Node) -> int | None:
    """The model's FLOPs of a token-grouped FP8 wgrad (``fp8_gemm`` with offsets over two 2-D
    operands), ``2 * M * N * T`` over the T rows of the quantize whose copy is its first operand,
    else None. Its operands may be in the 16-aligned token layout (rowwise:
    ``providers.aligns_tokens``), whose zero padding columns are no GEMM of the model's, so their
    shapes' contraction overstates it."""
    offs = node.kwargs.get("offs", node.args[9] if len(node.args) > 9 else None)
    a, b = node.args[0], node.args[2]
    if offs is None or not all(isinstance(t, fx.Node) for t in (a, b)):
        return None
    a_val, b_val = a.meta.get("val"), b.meta.get("val")
    if a_val is None or b_val is None or a_val.dim() != 2 or b_val.dim() != 2:
        return None
    quantize = a.args[0] if a.op == "call_function" and a.args else None
    if not isinstance(quantize, fx.Node) or op_name(quantize) != "graphpass.quantize":
        return None
    x = quantize.args[0].meta.get("val")
    if x is None or x.dim() != 2:
        return None
    return _compat.size_hint(2 * a_val.shape[0] * b_val.shape[0] * x.shape[0],
                             where=f"the FLOPs of {node.name} (graphpass.fp8_gemm)")


def coverage(joint: fx.GraphModule) -> dict:
    """The FP8 share of a step's GEMM FLOPs (per phase) and the high-precision FLOPs per reason.

    JSON-ready: ``{"fp8_share", "gemm_flops": {phase: n}, "fp8_flops": {phase: n},
    "high_precision_flops": {reason: n}}``.
    """
    cov = {"gemm_flops": dict.fromkeys(PHASES, 0), "fp8_flops": dict.fromkeys(PHASES, 0),
           "high_precision_flops": {}}
    for g in gemms(joint):
        cov["gemm_flops"][g.phase] += g.flops
        if g.reason is None:
            cov["fp8_flops"][g.phase] += g.flops
        else:
            hp = cov["high_precision_flops"]
            hp[g.reason] = hp.get(g.reason, 0) + g.flops
    return with_share(cov)


def _strip(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and op_name(node) in PASS_THROUGH:
        node = node.args[0]
    return node


def _form(node: fx.Node) -> str:
    """Why graphpass has no FP8 lowering for this GEMM, from its op and operands."""
    name = op_name(node)
    tensors = [a for a in node.args if isinstance(a, fx.Node)]
    if name in ("aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm"):
        a, b = (_strip(t) for t in tensors[-2:])
    else:
        a, b = (_strip(t) for t in tensors[:2])
    weight = next((t for t in (b, a) if t.op == "placeholder"), None)
    if weight is None and any(_gathered_weight(t) for t in (a, b)):
        return (f"{name} over expert weights gathered per token (e.g. transformers' batched_mm "
                "experts) is not lowered to FP8")
    if name == "aten._grouped_mm":
        return "grouped GEMM (torch._grouped_mm) is not lowered to FP8"
    if name in ("aten.bmm", "aten.baddbmm") and weight is not None and weight.meta["val"].dim() == 3:
        return "grouped GEMM (bmm over 3-D expert weights) is not lowered to FP8"
    if weight is None:
        return (f"{name} of two activations (no weight operand, e.g. attention scores); "
                "graphpass lowers GEMMs against a weight")
    return f"{name} is not a GEMM form graphpass lowers to FP8"


def _gathered_weight(node: fx.Node) -> bool:
    """Whether ``node`` is rows of a 3-D weight placeholder picked by an index."""
    if node.op != "call_function" or op_name(node) not in GATHERS:
        return False
    source = _strip(node.args[0])
    return source.op == "placeholder" and source.meta["val"].dim() == 3


def _weight_gradient_gemms(joint: fx.GraphModule) -> set[fx.Node]:
    """Backward GEMMs whose result is the gradient of a weight: a primal that is the second
    operand (B) of a forward GEMM. The joint graph returns one gradient per primal, last."""
    primals = primals_of(joint)
    outputs = list(joint.graph.find_nodes(op="output")[0].args[0])
    grad_of = gradients(joint)
    weights = set()
    for node in joint.graph.nodes:
        if is_gemm(node) and not is_backward(node):
            tensors = [a for a in node.args if isinstance(a, fx.Node)]
            b = tensors[-1] if op_name(node) in ("aten.mm", "aten.addmm", "aten.bmm") else (
                tensors[1] if len(tensors) > 1 else tensors[0])
            weights.add(_strip(b))
            # expert weights gathered per token may be either operand
            weights.update(_strip(t.args[0]) for t in map(_strip, tensors) if _gathered_weight(t))
    found: set[fx.Node] = set()
    for weight in weights:
        stack = [grad_of.get(weight)]
        while stack:
            node = stack.pop()
            if not isinstance(node, fx.Node) or node.op != "call_function":
                continue
            if is_gemm(node):
                found.add(node)
            elif op_name(node) in PASS_THROUGH:
                stack.append(node.args[0])
            elif op_name(node) == "aten.add" or op_name(node) in SCATTERS:
                # a weight used twice has its gradients summed; a gathered one, scattered back
                stack += [a for a in node.args if isinstance(a, fx.Node)]
    return found
