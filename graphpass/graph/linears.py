"""Finding each linear layer's three GEMMs in the joint graph.

After AOTAutograd (with Inductor's decompositions) a linear ``y = x @ W.T + b`` reads as

    fprop:  mm(x2d, permute(W, [1, 0]))        or addmm(b, x2d, permute(W, [1, 0]))
    dgrad:  mm(g2d, permute(permute(W)))        dX = dY @ W    (backward)
    wgrad:  mm(permute(g2d, [1, 0]), x2d)       dW = dY.T @ X  (backward)

where ``x2d`` is x itself or its 2-D view for 3-D inputs, and under autocast W is read through
a dtype cast. A weight stored ``[in, out]`` (GPT-2's ``Conv1D``: ``y = x @ W + b``) reads

    fprop:  mm(x2d, W)                          or addmm(b, x2d, W)
    dgrad:  mm(g2d, permute(W, [1, 0]))         dX = dY @ W.T
    wgrad:  mm(permute(x2d, [1, 0]), g2d)       dW = X.T @ dY We follow operands from each forward GEMM to a weight placeholder, then find the
backward GEMMs that read the same weight and the same ``x2d``.

A weight all-gathered inside the graph (torchtitan's SimpleFSDP: each parameter is this rank's
shard, gathered by ``_c10d_functional.all_gather_into_tensor`` and its ``wait_tensor`` before
the GEMMs read it) is found through the gather: ``Linear.weight`` is the shard's placeholder,
``Linear.w`` the gathered weight the GEMMs read, and the weight's gradient the backward's
reduce-scatter of wgrad's result.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from .joint import gradients, primals as primals_of
from .nodes import is_backward, module_path, op_name
from .ops import CASTS, COLLECTIVE_GATHERS, COLLECTIVE_WAITS, TRANSPOSES



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
    stored_kn: bool = False
    """The weight is stored (K, N) = [in, out] (GPT-2 ``Conv1D``), so ``w`` is W, not W.T's base
    of shape (N, K)."""
    offs: fx.Node | None = None
    """Token-grouped experts (``torch._grouped_mm`` with offsets): the group ends over x's rows.
    ``x`` is then (tokens, K) and ``w`` (experts, N, K), or (experts, K, N) when ``stored_kn``."""
    fused_backward: fx.Node | None = None
    """A library op computing dgrad and wgrad in one node (transformers' grouped_mm fallback
    backward): ``dgrad`` and ``wgrad`` are then its ``getitem`` outputs."""
    wgrad_flipped: bool = False
    """Token-grouped experts: the weight's gradient is ``wgrad`` transposed, the GEMM computing
    the other orientation (``x.T @ dY`` for a weight stored (experts, N, K), ``dY.T @ x`` for
    one stored (experts, K, N)): autograd gives the gradient the weight's strides, so it does
    this for a weight whose strides are its transpose's (a non-contiguous parameter)."""


def _untranspose(node: fx.Node) -> tuple[fx.Node, bool]:
    """Strip 2-D transposes: (base, whether an odd number of them was stripped)."""
    flipped = False
    while node.op == "call_function" and op_name(node) in TRANSPOSES and _is_2d_transpose(node):
        node, flipped = node.args[0], not flipped
    return node, flipped


def _uncast(node: fx.Node) -> fx.Node:
    """Strip dtype casts, and an in-graph all-gather of the tensor (its wait and the collective:
    a SimpleFSDP weight is gathered from this rank's shard, cast before or after)."""
    while node.op == "call_function":
        if op_name(node) in CASTS:
            node = node.args[0]
        elif gathered_from(node) is not None:
            node = gathered_from(node)
        else:
            break
    return node


def gathered_from(node: fx.Node) -> fx.Node | None:
    """The tensor ``node`` all-gathers, where ``node`` is ``wait_tensor(all_gather_into_tensor(
    x, ...))`` (dim 0, as the functional collective gathers), or its first rows (uneven shards:
    DTensor pads each to the largest and slices the padding off the gathered tensor): ``x``;
    else None."""
    if (op_name(node) == "aten.slice" and isinstance(node.args[0], fx.Node)
            and tuple(node.args[1:3]) == (0, 0) and gathered_from(node.args[0]) is not None):
        node = node.args[0]
    if op_name(node) not in COLLECTIVE_WAITS or not isinstance(node.args[0], fx.Node):
        return None
    gather = node.args[0]
    if op_name(gather) not in COLLECTIVE_GATHERS or not isinstance(gather.args[0], fx.Node):
        return None
    return gather.args[0]


def _unscatter(node: fx.Node) -> fx.Node:
    """Strip casts and a reduce-scatter (its wait and the collective) from a weight's gradient:
    under SimpleFSDP the shard's gradient is wgrad's result reduce-scattered."""
    while node.op == "call_function":
        if op_name(node) in CASTS:
            node = node.args[0]
        elif (op_name(node) in COLLECTIVE_WAITS and isinstance(node.args[0], fx.Node)
              and op_name(node.args[0]) == "_c10d_functional.reduce_scatter_tensor"):
            node = _unpadded(node.args[0].args[0])
        else:
            break
    return node


def _unpadded(node: fx.Node) -> fx.Node:
    """``x`` where ``node`` is x's dim-0 pieces concatenated, the last ones zero-padded (DTensor
    reduce-scatters a gradient of uneven shards so: ``cat([split(x)[0], ...,
    constant_pad_nd(split(x)[-1])])``); else ``node``."""
    if op_name(node) != "aten.cat" or (len(node.args) > 1 and node.args[1] != 0):
        return node
    bases = set()
    for piece in node.args[0]:
        if op_name(piece) == "aten.constant_pad_nd" and piece.args[2:3] in ((), (0.0,), (0,)):
            piece = piece.args[0]
        if op_name(piece) != "getitem" or op_name(piece.args[0]) not in ("aten.split",
                                                                          "aten.split_with_sizes"):
            return node
        bases.add(piece.args[0].args[0])
    return bases.pop() if len(bases) == 1 else node


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
        if weight.op != "placeholder" or len(weight.meta["val"].shape) != 2:
            continue
        if bias is not None and len(bias.meta["val"].shape) != 1:
            continue  # addmm with a full matrix is not a linear's bias
        linears.append(Linear(module_path(node), weight, w, x, node, bias, stored_kn=not flipped))

    # wgrad: the backward GEMM whose result is the weight's gradient output. The joint graph
    # returns (forward outputs..., one gradient per primal), so gradients are the last outputs.
    primals = primals_of(joint)
    outputs = list(joint.graph.find_nodes(op="output")[0].args[0])
    grad_of = gradients(joint)
    for lin in linears:
        grad = grad_of.get(lin.weight)
        # a weight shared with another use (GPT-2's lm_head tied to the embedding) gets the sum
        # of its gradients: look at each term
        terms, stack = [], [grad]
        while stack:
            term = stack.pop()
            if isinstance(term, fx.Node) and op_name(term) == "aten.add":
                stack += term.args
            elif isinstance(term, fx.Node):
                terms.append(term)
        for term in terms:
            base, flipped = _untranspose(_uncast(_unscatter(term)))
            if flipped or op_name(base) != "aten.mm" or not is_backward(base):
                continue
            # dW = dY.T @ X (N, K), or for a stored [in, out] weight dW = X.T @ dY (K, N)
            x_arg, t_arg = (base.args[0], base.args[0]) if lin.stored_kn else (base.args[1], base.args[0])
            x_base, x_flipped = _untranspose(x_arg)
            if lin.stored_kn and x_flipped and x_base is lin.x:
                lin.wgrad = base
            elif not lin.stored_kn and x_arg is lin.x and _untranspose(t_arg)[1]:
                lin.wgrad = base

    # dgrad: a backward dY @ W. With several linears on one weight, the one whose wgrad reads
    # the same dY.
    for node in _calls(joint):
        if not is_backward(node) or op_name(node) != "aten.mm":
            continue
        g, w = node.args
        base, flipped = _untranspose(w)
        base = _uncast(base)
        if base.op != "placeholder":
            continue
        # dX = dY @ W reads W itself (its transpose twice); a stored [in, out] W, transposed once
        candidates = [lin for lin in linears
                      if lin.weight is base and lin.dgrad is None and lin.stored_kn == flipped]
        if len(candidates) > 1:
            candidates = [lin for lin in candidates if lin.wgrad is not None and _grad_of_wgrad(lin) is g]
        if len(candidates) == 1:
            candidates[0].dgrad = node
    return linears


def _grad_of_wgrad(lin: Linear) -> fx.Node:
    """The dY a linear's wgrad reads (its second operand when the weight is stored [in, out])."""
    return lin.wgrad.args[1] if lin.stored_kn else _untranspose(lin.wgrad.args[0])[0]


def _calls(joint: fx.GraphModule) -> list[fx.Node]:
    return [n for n in joint.graph.nodes if n.op == "call_function"]


def _batch_transposed(node: fx.Node) -> fx.Node | None:
    """``node``'s base if it is ``permute(base, [0, 2, 1])`` (a transpose of each group)."""
    if op_name(node) == "aten.permute" and list(node.args[1]) == [0, 2, 1]:
        return node.args[0]
    if op_name(node) == "aten.transpose" and sorted(d % 3 for d in node.args[1:3]) == [1, 2]:
        return node.args[0]
    return None


def _same_value(a: fx.Node, b: fx.Node) -> bool:
    """``a`` and ``b`` are one tensor: the same node, or the same view of the same base (the
    backward may re-view a forward tensor)."""
    if a is b:
        return True
    views = ("aten.view", "aten.reshape", "aten._unsafe_view")
    return (op_name(a) in views and op_name(b) in views and a.args[0] is b.args[0]
            and a.meta["val"].shape == b.meta["val"].shape)


def find_grouped(joint: fx.GraphModule) -> list[Linear]:
    """Capacity-style MoE experts: ``bmm(x, W)`` with W a 3-D [experts, in, out] weight.

    Per expert this is a linear whose weight is stored [in, out] (see the module docstring),
    with the expert as a leading group dimension: fprop ``bmm(x, W)``, dgrad
    ``bmm(dY, permute(W, [0, 2, 1]))``, wgrad ``bmm(permute(x, [0, 2, 1]), dY)``.
    """
    found: list[Linear] = []
    for node in _calls(joint):
        if is_backward(node) or op_name(node) != "aten.bmm":
            continue
        x, w = node.args
        weight = _uncast(w)
        if weight.op == "placeholder" and weight.meta["val"].dim() == 3:
            found.append(Linear(module_path(node), weight, w, x, node, stored_kn=True))

    primals = primals_of(joint)
    outputs = list(joint.graph.find_nodes(op="output")[0].args[0])
    grad_of = gradients(joint)
    for lin in found:
        grad = grad_of.get(lin.weight)
        base = _uncast(grad) if isinstance(grad, fx.Node) else None
        if base is not None and op_name(base) == "aten.bmm" and is_backward(base):
            xt = _batch_transposed(base.args[0])
            if xt is not None and _same_value(xt, lin.x):
                lin.wgrad = base
    for node in _calls(joint):
        if not is_backward(node) or op_name(node) != "aten.bmm":
            continue
        g, wt = node.args
        w = _batch_transposed(wt)
        if w is None:
            continue
        candidates = [lin for lin in found if lin.w is w and lin.dgrad is None]
        if len(candidates) > 1:
            candidates = [lin for lin in candidates if lin.wgrad is not None and lin.wgrad.args[1] is g]
        if len(candidates) == 1:
            candidates[0].dgrad = node
    return found


GROUPED_MM = "aten._grouped_mm"
FALLBACK = "transformers.grouped_mm_fallback"


def _batch_untranspose(node: fx.Node) -> tuple[fx.Node, bool]:
    """Strip per-group transposes: (base, whether an odd number was stripped)."""
    flipped = False
    while node.op == "call_function" and _batch_transposed(node) is not None:
        node, flipped = _batch_transposed(node), not flipped
    return node, flipped


def find_grouped_offsets(joint: fx.GraphModule) -> list[Linear]:
    """Token-grouped MoE experts: ``_grouped_mm(x, W, offs)`` with x (T, K) sorted by expert and
    W a 3-D weight (transformers 5.x, torchtitan), or transformers' ``grouped_mm_fallback`` custom
    op (the same product, where torch's grouped_mm does not run).

    For W stored (E, N, K) (read through ``permute(W, [0, 2, 1])``) autograd gives dgrad
    ``_grouped_mm(dY, W, offs)`` and wgrad ``_grouped_mm(dY.T, x, offs)`` (E, N, K); for W stored
    (E, K, N): dgrad ``_grouped_mm(dY, permute(W), offs)``, wgrad ``_grouped_mm(x.T, dY, offs)``.
    The fallback's backward op returns (dX, dW) of its (E, K, N) weight operand.
    """
    found: list[Linear] = []
    for node in _calls(joint):
        name = op_name(node)
        if is_backward(node) or name not in (GROUPED_MM, FALLBACK):
            continue
        args = list(node.args) + [None] * 3
        x, wop = args[0], args[1]
        offs = node.kwargs.get("offs", args[2])
        if name == GROUPED_MM and (node.kwargs.get("bias", args[3]) is not None
                                   or node.kwargs.get("out_dtype", args[4]) is not None):
            continue
        if not isinstance(offs, fx.Node) or x.meta["val"].dim() != 2:
            continue
        w, flipped = _batch_untranspose(wop)
        weight = _uncast(w)
        if weight.op != "placeholder" or weight.meta["val"].dim() != 3:
            continue
        found.append(Linear(module_path(node), weight, w, x, node, stored_kn=not flipped,
                            offs=offs))

    primals = primals_of(joint)
    outputs = list(joint.graph.find_nodes(op="output")[0].args[0])
    grad_of = gradients(joint)
    for lin in found:
        grad = grad_of.get(lin.weight)
        if not isinstance(grad, fx.Node):
            continue
        base, flipped = _batch_untranspose(grad)
        if op_name(lin.fprop) == FALLBACK:
            # dW of the (E, K, N) operand, which is W itself when stored (E, K, N)
            if (op_name(base) == "getitem" and base.args[1] == 1
                    and op_name(base.args[0]) == "transformers.grouped_mm_fallback_backward"
                    and flipped != lin.stored_kn):
                bw = base.args[0]
                if bw.args[0] is lin.x and bw.args[2] is lin.offs:
                    outs = {u.args[1]: u for u in bw.users if op_name(u) == "getitem"}
                    if set(outs) <= {0, 1} and 1 in outs:
                        lin.fused_backward, lin.wgrad, lin.dgrad = bw, outs[1], outs.get(0)
            continue
        if op_name(base) != GROUPED_MM or not is_backward(base):
            continue
        a, b = base.args[:2]
        if base.kwargs.get("offs", base.args[2] if len(base.args) > 2 else None) is not lin.offs:
            continue
        # (E, N, K): dW = dY.T @ x; (E, K, N): dW = x.T @ dY; a gradient transposed after the
        # GEMM (a weight with its transpose's strides) is the other orientation's GEMM
        kn = lin.stored_kn != flipped
        xt, dy = (a, b) if kn else (b, a)
        x_base, x_flip = _untranspose(xt)
        g_base, g_flip = _untranspose(dy)
        if (x_flip == kn and g_flip != kn and _same_value(x_base, lin.x)):
            lin.wgrad, lin.wgrad_flipped = base, flipped
    for node in _calls(joint):
        if not is_backward(node) or op_name(node) != GROUPED_MM:
            continue
        g, wop = node.args[:2]
        offs = node.kwargs.get("offs", node.args[2] if len(node.args) > 2 else None)
        if wop.meta["val"].dim() != 3:
            continue
        w, flipped = _batch_untranspose(wop)
        # dX = dY @ W per group: W (E, N, K) as stored, or an (E, K, N) one transposed once
        candidates = [lin for lin in found if lin.w is w and lin.offs is offs and lin.dgrad is None
                      and lin.fused_backward is None and flipped == lin.stored_kn]
        if len(candidates) > 1 and all(c.wgrad is not None for c in candidates):
            candidates = [c for c in candidates
                          if _untranspose(c.wgrad.args[1 if c.stored_kn else 0])[0] is g]
        if len(candidates) == 1:
            candidates[0].dgrad = node
    return found
