"""The model's output head, recognised from the graph rather than by its name.

A head is a plain linear (a 2-D weight) whose forward output reaches the loss or a forward
output of the graph through no other GEMM or attention (views, casts, elementwise ops,
reductions and the loss itself only), and which is one of:

- read by a log-softmax on that way (the op, or ``log(sum(exp(.)))`` as Inductor's
  decompositions write it): the linear whose output is the logits of a cross-entropy
  loss computed in the graph (a language model's ``lm_head``, a masked LM's ``decoder``, an image
  classifier's ``classifier``), whatever its width;
- at least ``WIDER`` times as wide as its input (N >= 4 K): a vocabulary projection, whether
  the graph returns its logits (for a loss computed outside) or computes another loss from
  them, the way there also passing no residual sum (an add of two activations of its shape)
  and no collective. No projection inside a transformer block has both: an MLP's
  up-projection (2.7-4 K) reaches its down-projection, a GEMM, before any output, and a block's
  output projections, which can be wider than their inputs (a row-parallel o_proj's shard under
  tensor parallelism: 8 K at TP 8), add into the residual stream, most after a reduce-scatter.

The FP8 lowering keeps such a head in high precision while ``fp8_exclude`` asks for the output
head by its names (``HEAD_PATTERNS``), so the head stays high precision however the model is
wrapped or named.
"""

from __future__ import annotations

import torch.fx as fx

from .linears import Linear
from .nodes import is_backward, op_name
from .ops import GEMM_OPS

WIDER = 4
"""How many times its input's width a head returned as logits is at least (N >= 4 K)."""
HEAD_PATTERNS = ("lm_head", "output")
"""``fp8_exclude`` patterns that name the output head; either one keeps a head recognised from
the graph in high precision."""
_LOG_SOFTMAX = frozenset({"aten._log_softmax", "aten.log_softmax", "aten.logsumexp"})


def _log_sum_exp(node: fx.Node) -> bool:
    """A log-softmax, as an op or as Inductor's decomposition writes it: ``log(sum(exp(.)))``."""
    if op_name(node) in _LOG_SOFTMAX:
        return True
    if op_name(node) != "aten.log" or not isinstance(node.args[0], fx.Node):
        return False
    total = node.args[0]
    return (op_name(total) == "aten.sum" and isinstance(total.args[0], fx.Node)
            and op_name(total.args[0]) == "aten.exp")


def _barrier(node: fx.Node) -> bool:
    name = op_name(node)
    return name in GEMM_OPS or "attention" in name


def output_heads(linears: list[Linear]) -> dict[fx.Node, str]:
    """The linears among ``linears`` that are output heads, by forward GEMM, each with how the
    graph shows it (for the report's note)."""
    heads = {}
    for lin in linears:
        w = lin.w.meta["val"]
        if lin.offs is not None or w.dim() != 2:
            continue
        n, k = (w.shape[-1], w.shape[-2]) if lin.stored_kn else (w.shape[-2], w.shape[-1])
        if _reaches(lin.fprop, _barrier)[0]:
            heads[lin.fprop] = "from the graph: the logits of a log-softmax, through no other GEMM"
        elif (isinstance(n, int) and isinstance(k, int) and n >= WIDER * k
              and _reaches(lin.fprop, _block_output)[1]):
            heads[lin.fprop] = (f"from the graph: a graph output through no other GEMM, {n} "
                                f"columns from {k}")
    return heads


def _block_output(node: fx.Node) -> bool:
    """A GEMM, attention, a collective, or a residual sum: an add of two activations of one
    shape (a bias, broadcast, is not one; a loss's difference from its target is a
    subtraction)."""
    if _barrier(node) or "c10d" in op_name(node):
        return True
    if op_name(node) != "aten.add":
        return False
    shapes = [getattr(a.meta.get("val"), "shape", None) for a in node.args[:2]
              if isinstance(a, fx.Node)]
    return len(shapes) == 2 and shapes[0] is not None and shapes[0] == shapes[1]


def _reaches(start: fx.Node, barrier) -> tuple[bool, bool]:
    """Whether the forward ops after ``start`` reach a log-softmax, and the graph's output,
    without passing a node ``barrier`` stops at."""
    seen, todo = {start}, [start]
    loss = output = False
    while todo:
        node = todo.pop()
        for user in node.users:
            if user.op == "output":
                output = True
                continue
            if user in seen or is_backward(user) or barrier(user):
                continue
            loss = loss or _log_sum_exp(user)
            seen.add(user)
            todo.append(user)
    return loss, output
