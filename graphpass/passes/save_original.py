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

This is about linear *inputs*, as TE's flag is. A weight's second copy (dgrad's) is left to the
min-cut, which re-quantizes it in the backward: the weight is resident anyway, so that costs no
memory, only one more read of the weight. ``fp8_save_quantized_weight`` quantizes both of a weight's
copies in one forward op instead and saves dgrad's (as TE does): one read of the weight per
step, for 1 byte per weight element held until the backward.
"""

from __future__ import annotations

import fnmatch
import operator

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..config import Config
from ..decisions import FACTS, Decision, Plan, What, facts
from ..fp8.ops import QUANTIZE
from ..graph.joint import Side, in_user_checkpoint, set_partition_side
from ..graph.nodes import is_backward, module_path, op_name, tensor_bytes
from .partitioner import TrialPartitioner



def save_original(joint: fx.GraphModule, plan: Plan, config: Config,
                  partitioner: TrialPartitioner) -> None:
    if config.fp8 is None:
        return
    rowwise: dict[tuple[fx.Node, str], fx.Node] = {}
    columnwise: list[fx.Node] = []
    weights: dict[fx.Node, dict[str, fx.Node]] = {}  # a weight's forward quantizes, by usage
    for node in joint.graph.nodes:
        if op_name(node) != "graphpass.quantize" or is_backward(node):
            continue
        x, _, role, usage = node.args[:4]
        if role == "weight":
            weights.setdefault(x, {})[usage] = node
        if role != "input":
            continue
        if usage == "rowwise":
            rowwise[(x, role, _offs(node))] = node
        elif usage == "columnwise":
            columnwise.append(node)
    for col in columnwise:
        x, recipe, role, _ = col.args[:4]
        policy = config.fp8_save_original_input
        if any(fnmatch.fnmatchcase(module_path(col), p) for p in config.fp8_save_original_input_modules):
            policy = "always"
        if policy == "always":
            for node in (col, *col.users):
                set_partition_side(node, Side.MUST_BE_IN_BACKWARD)
        elif policy == "never" and (x, role, _offs(col)) in rowwise:
            merge_usages(joint.graph, rowwise[(x, role, _offs(col))], col)
    if config.fp8_save_quantized_weight:
        for w, by_usage in weights.items():
            _weight_once(joint.graph, plan, w, by_usage)
    joint.graph.lint()
    joint.recompile()


def _weight_once(graph: fx.Graph, plan: Plan, w: fx.Node, by_usage: dict[str, fx.Node]) -> None:
    """Both of ``w``'s copies from one forward quantize, saved for the backward; a note either
    way (a weight no dgrad reads, such as a frozen layer's input projection, has one copy)."""
    row, col = by_usage.get("rowwise"), by_usage.get("columnwise")
    module = module_path(row or col)
    if row is None or col is None:
        plan.decide(Decision(What.WEIGHT_ONCE, "fp8_save_quantized_weight", "the weight has one FP8 copy "
                             "(no dgrad reads it): nothing to save", module, w.name))
        return
    # the copy the backward reads: dgrad's (the columnwise one, the rowwise one for a weight
    # stored [in, out])
    backward = col if any(is_backward(u) for g in col.users for u in g.users) else row
    nbytes = sum(tensor_bytes(v, where=f"fp8_save_quantized_weight's size of {w.name}")
                 for v in backward.meta["val"])
    merge_usages(graph, row, col)
    plan.decide(Decision(What.WEIGHT_ONCE, "fp8_save_quantized_weight",
                         "the weight's two FP8 copies quantized in the forward, from one read; "
                         f"dgrad's copy saved ({nbytes:,} B)", module, w.name))


def _offs(quantize: fx.Node) -> fx.Node | None:
    """A grouped quantize's offsets (experts over token groups), else None."""
    return quantize.args[4] if len(quantize.args) > 4 else None


def merge_usages(graph: fx.Graph, row: fx.Node, col: fx.Node) -> fx.Node:
    """One ``usage="both"`` quantize in place of a rowwise and a columnwise one, where the first
    of them was: the new node. A forward one is saved (unless the user's checkpoint region
    recomputes it)."""
    x, recipe, role, _ = row.args[:4]
    first = next(n for n in graph.nodes if n is row or n is col)
    with graph.inserting_before(first):
        both = graph.call_function(QUANTIZE, (x, recipe, role, "both", *row.args[4:]))
        both.meta = {**row.meta, "val": [*row.meta["val"], *col.meta["val"]]}
        if not is_backward(row) and not in_user_checkpoint(row):
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
    return both
