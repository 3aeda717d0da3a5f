"""Save the original or the FP8 copy of each quantized tensor the backward needs.

The lowering quantizes a forward tensor once per usage: rowwise for the forward GEMM and, in a
separate node, columnwise for wgrad/dgrad. That columnwise node is read only by the backward, so
torch's min-cut may place it on either side: save the 1-byte copy, or save the original (when it
is saved anyway, or recomputed) and re-quantize in the backward. Stateless recipes make the
re-quantized bits identical to the forward's, so this choice never changes numerics.

* ``auto``: leave the choice to the min-cut, which counts bytes in the real dtypes;
* ``always``: pin the columnwise quantize in the backward (TE's ``save_original_input``);
* ``never``: quantize both usages in one forward op whose outputs cannot be recomputed, so the
  FP8 copy is saved (Transformer Engine's default).

This is about linear *inputs*, as TE's flag is. A weight's columnwise copy is always left to the
min-cut: the weight is resident anyway, so re-quantizing it in the backward costs no memory.
"""

from __future__ import annotations

import fnmatch
import operator

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from .. import _compat
from ..config import Config
from ..decisions import FACTS, Plan, facts
from ..fp8.ops import QUANTIZE
from ..graph.nodes import is_backward, module_path, op_name



def save_original(joint: fx.GraphModule, plan: Plan, config: Config) -> None:
    if config.fp8 is None:
        return
    rowwise: dict[tuple[fx.Node, str], fx.Node] = {}
    columnwise: list[fx.Node] = []
    for node in joint.graph.nodes:
        if op_name(node) != "graphpass.quantize" or is_backward(node):
            continue
        x, _, role, usage = node.args[:4]
        if role != "input":
            continue
        if usage == "rowwise":
            rowwise[(x, role, _offs(node))] = node
        elif usage == "columnwise":
            columnwise.append(node)
    for col in columnwise:
        x, recipe, role, _ = col.args[:4]
        policy = config.save_original
        if any(fnmatch.fnmatchcase(module_path(col), p) for p in config.save_original_modules):
            policy = "always"
        if policy == "always":
            for node in (col, *col.users):
                _compat.set_partition_side(node, "must_be_in_backward")
        elif policy == "never" and (x, role, _offs(col)) in rowwise:
            _merge(joint.graph, rowwise[(x, role, _offs(col))], col)
    joint.graph.lint()
    joint.recompile()


def _offs(quantize: fx.Node) -> fx.Node | None:
    """A grouped quantize's offsets (experts over token groups), else None."""
    return quantize.args[4] if len(quantize.args) > 4 else None


def _merge(graph: fx.Graph, row: fx.Node, col: fx.Node) -> None:
    """One ``usage="both"`` quantize in place of a rowwise and a columnwise one."""
    x, recipe, role, _ = row.args[:4]
    with graph.inserting_before(row):
        both = graph.call_function(QUANTIZE, (x, recipe, role, "both", *row.args[4:]))
        both.meta = {**row.meta, "val": [*row.meta["val"], *col.meta["val"]]}
        # saved in the forward, unless the user's checkpoint region recomputes it
        if not _compat.in_user_checkpoint(row):
            both.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        outs = []
        for i in range(4):
            out = graph.call_function(operator.getitem, (both, i))
            out.meta = {**row.meta, "val": both.meta["val"][i]}
            outs.append(out)
    for old, offset in ((row, 0), (col, 2)):
        for user in list(old.users):
            index = user.args[1]
            new = outs[offset + index]
            new.meta[FACTS] = facts(user)  # which usage it is, a scale or not
            user.replace_all_uses_with(new)
            graph.erase_node(user)
        graph.erase_node(old)
