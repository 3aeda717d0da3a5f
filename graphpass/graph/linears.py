"""Finding each linear layer's three GEMMs in the joint graph.

After AOTAutograd (with Inductor's decompositions) a linear ``y = x @ W.T + b`` reads as

    fprop:  mm(x2d, permute(W, [1, 0]))        or addmm(b, x2d, permute(W, [1, 0]))
    dgrad:  mm(g2d, permute(permute(W)))        dX = dY @ W    (backward)
    wgrad:  mm(permute(g2d, [1, 0]), x2d)       dW = dY.T @ X  (backward)

where ``x2d`` is x itself or its 2-D view for 3-D inputs, and under autocast W is read through
a dtype cast. We follow operands from each forward GEMM to a weight placeholder, then find the
backward GEMMs that read the same weight and the same ``x2d``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from .nodes import is_backward, module_path, op_name

_TRANSPOSES = ("aten.permute", "aten.t")
_CASTS = ("prims.convert_element_type", "aten._to_copy")


@dataclass
class Linear:
    module: str
    weight: fx.Node
    """The weight's placeholder (a parameter, or a primal of a traced function)."""
    w: fx.Node
    """The (N, K) weight the GEMMs read: ``weight`` itself, or its cast under autocast."""
    x: fx.Node
    fprop: fx.Node
    bias: fx.Node | None = None
    dgrad: fx.Node | None = None
    wgrad: fx.Node | None = None


def _untranspose(node: fx.Node) -> tuple[fx.Node, bool]:
    """Strip 2-D transposes: (base, whether an odd number of them was stripped)."""
    flipped = False
    while node.op == "call_function" and op_name(node) in _TRANSPOSES and _is_2d_transpose(node):
        node, flipped = node.args[0], not flipped
    return node, flipped


def _uncast(node: fx.Node) -> fx.Node:
    while node.op == "call_function" and op_name(node) in _CASTS:
        node = node.args[0]
    return node


def _is_2d_transpose(node: fx.Node) -> bool:
    if op_name(node) == "aten.t":
        return True
    dims = node.args[1] if len(node.args) > 1 else None
    return list(dims or []) == [1, 0]


def find_linears(joint: fx.GraphModule) -> list[Linear]:
    linears: list[Linear] = []
    for node in _calls(joint):
        name = op_name(node)
        if is_backward(node) or name not in ("aten.mm", "aten.addmm"):
            continue
        bias = node.args[0] if name == "aten.addmm" else None
        x, wt = node.args[-2:]
        w, flipped = _untranspose(wt)
        weight = _uncast(w)
        if not flipped or weight.op != "placeholder" or len(weight.meta["val"].shape) != 2:
            continue
        if bias is not None and len(bias.meta["val"].shape) != 1:
            continue  # addmm with a full matrix is not a linear's bias
        linears.append(Linear(module_path(node), weight, w, x, node, bias))

    # wgrad: the backward GEMM whose result is the weight's gradient output. The joint graph
    # returns (forward outputs..., one gradient per primal), so gradients are the last outputs.
    primals = [n for n in joint.graph.find_nodes(op="placeholder") if "tangents" not in n.name]
    outputs = list(joint.graph.find_nodes(op="output")[0].args[0])
    grad_of = dict(zip(primals, outputs[len(outputs) - len(primals):]))
    for lin in linears:
        grad = grad_of.get(lin.weight)
        if not isinstance(grad, fx.Node):
            continue
        base, flipped = _untranspose(_uncast(grad))
        if (not flipped and op_name(base) == "aten.mm" and is_backward(base)
                and base.args[1] is lin.x and _untranspose(base.args[0])[1]):
            lin.wgrad = base

    # dgrad: a backward dY @ W. With several linears on one weight, the one whose wgrad reads
    # the same dY.
    for node in _calls(joint):
        if not is_backward(node) or op_name(node) != "aten.mm":
            continue
        g, w = node.args
        base, flipped = _untranspose(w)
        base = _uncast(base)
        if flipped or base.op != "placeholder":
            continue
        candidates = [lin for lin in linears if lin.weight is base and lin.dgrad is None]
        if len(candidates) > 1:
            candidates = [lin for lin in candidates
                          if lin.wgrad is not None and _untranspose(lin.wgrad.args[0])[0] is g]
        if len(candidates) == 1:
            candidates[0].dgrad = node
    return linears


def _calls(joint: fx.GraphModule) -> list[fx.Node]:
    return [n for n in joint.graph.nodes if n.op == "call_function"]
