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

from ..decisions import facts
from .flops import node_flops
from .nodes import VIEWS, is_backward, module_path, op_name

# Matrix products: dense, batched, grouped, vector, and their FP8 (scaled) variants.
GEMM_OPS = frozenset({
    "aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.addbmm", "aten.mv", "aten.addmv",
    "aten.dot", "aten._grouped_mm", "aten._scaled_mm", "aten._scaled_mm_v2",
    "aten._scaled_grouped_mm", "aten._scaled_grouped_mm_v2", "graphpass.fp8_gemm",
})
# GEMMs behind custom ops of libraries, by op name: (phases of its GEMMs, their operand indices).
# transformers' grouped_mm fallback (its MoE experts where torch's grouped_mm cannot run, e.g.
# float32 on CPU) computes input (T, K) x weight (E, K, N) per group; its backward op both
# gradients, one GEMM each of the same size.
_LIBRARY_GEMMS = {
    "transformers.grouped_mm_fallback": ("forward",),
    "transformers.grouped_mm_fallback_backward": ("dgrad", "wgrad"),
}
GEMM_OPS = GEMM_OPS | frozenset(_LIBRARY_GEMMS)
_FP8_OPS = frozenset({"graphpass.fp8_gemm", "aten._scaled_mm", "aten._scaled_mm_v2",
                      "aten._scaled_grouped_mm", "aten._scaled_grouped_mm_v2"})
PHASES = ("forward", "dgrad", "wgrad")

_ROLES_PHASE = {"input,weight": "forward", "grad,weight": "dgrad", "grad,input": "wgrad",
                "input,grad": "wgrad"}
_CASTS = ("prims.convert_element_type", "aten._to_copy")
_PASS_THROUGH = VIEWS | set(_CASTS) | {"aten.clone", "aten.contiguous"}
# Rows of a weight picked per token or per expert (transformers' batched_mm experts), and the
# ops their gradients are scattered back with.
_GATHERS = ("aten.index", "aten.index_select", "aten.embedding", "aten.gather")
_SCATTERS = ("aten.index_put", "aten._unsafe_index_put", "aten.index_add", "aten.scatter_add",
             "aten.embedding_dense_backward")


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
        if name in _LIBRARY_GEMMS:
            a, b = (t.meta["val"] for t in node.args[:2])
            flops = _grouped_mm_flops(a.shape, b.shape, out_shape=(*a.shape[:-1], b.shape[-1]))
            op = name.removesuffix('_backward').replace('.', '::')  # one reason for both
            reason = f"grouped GEMM ({op}, a custom op) is not lowered to FP8"
            out += [Gemm(node, module_path(node), phase, flops, reason)
                    for phase in _LIBRARY_GEMMS[name]]
            continue
        if name == "graphpass.fp8_gemm":
            phase = _ROLES_PHASE.get(node.args[5], "forward")
        elif not is_backward(node):
            phase = "forward"
        else:
            phase = "wgrad" if node in wgrads else "dgrad"
        reason = None
        if name not in _FP8_OPS:
            if facts(node).not_lowered:
                reason = facts(node).not_lowered
            elif phase == "forward":
                reason = _form(node)
            else:  # a backward GEMM shares its forward GEMM's sequence number
                reason = forward_reason.get(node.meta.get("seq_nr"), _form(node))
            if phase == "forward" and "seq_nr" in node.meta:
                forward_reason[node.meta["seq_nr"]] = reason
        out.append(Gemm(node, module_path(node), phase, node_flops(node), reason))
    return out


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
    return _with_share(cov)


def merge_coverage(parts: list[dict]) -> dict:
    """The coverage of several graphs (a model split by graph breaks) as one step."""
    cov = {"gemm_flops": dict.fromkeys(PHASES, 0), "fp8_flops": dict.fromkeys(PHASES, 0),
           "high_precision_flops": {}}
    for part in parts:
        for key in ("gemm_flops", "fp8_flops", "high_precision_flops"):
            for k, v in part[key].items():
                cov[key][k] = cov[key].get(k, 0) + v
    return _with_share(cov)


def _with_share(cov: dict) -> dict:
    total = sum(cov["gemm_flops"].values())
    cov["fp8_share"] = sum(cov["fp8_flops"].values()) / total if total else 1.0
    return cov


def coverage_lines(cov: dict) -> list[str]:
    """The report's text: one totals line, then one line per high-precision reason."""
    def share(phase: str) -> str:
        total = cov["gemm_flops"][phase]
        return f"{phase} {cov['fp8_flops'][phase] / total:.1%}" if total else f"{phase} -"

    total = sum(cov["gemm_flops"].values())
    lines = [f"fp8: {cov['fp8_share']:.1%} of {total:,} GEMM FLOPs run as FP8 GEMMs ("
             + ", ".join(map(share, PHASES)) + ")"]
    for reason, flops in sorted(cov["high_precision_flops"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  high precision: {flops / total:.1%} ({flops:,} FLOPs): {reason}")
    return lines


def _strip(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and op_name(node) in _PASS_THROUGH:
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
    if node.op != "call_function" or op_name(node) not in _GATHERS:
        return False
    source = _strip(node.args[0])
    return source.op == "placeholder" and source.meta["val"].dim() == 3


def _weight_gradient_gemms(joint: fx.GraphModule) -> set[fx.Node]:
    """Backward GEMMs whose result is the gradient of a weight: a primal that is the second
    operand (B) of a forward GEMM. The joint graph returns one gradient per primal, last."""
    primals = [n for n in joint.graph.find_nodes(op="placeholder") if "tangents" not in n.name]
    outputs = list(joint.graph.find_nodes(op="output")[0].args[0])
    grad_of = dict(zip(primals, outputs[len(outputs) - len(primals):]))
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
            elif op_name(node) in _PASS_THROUGH:
                stack.append(node.args[0])
            elif op_name(node) == "aten.add" or op_name(node) in _SCATTERS:
                # a weight used twice has its gradients summed; a gathered one, scattered back
                stack += [a for a in node.args if isinstance(a, fx.Node)]
    return found
