"""The FP8 GEMMs of a weight FSDP2 all-gathered in FP8 read the gathered bytes, not a quantize.

A weight ``graphpass.fsdp_fp8_weights`` wrapped reaches the compiled graph as two inputs, the
gathered E4M3 data and its scales (``fp8/fsdp.py``), and its value as
``graphpass::fsdp_fp8_weight(data, scale_inv, dtype, recipe)``. After ``lower_fp8``, that value
is read by the weight quantizes of its FP8 GEMMs only; each becomes

    rowwise     (data, scale_inv)                              the gathered bytes as they are
    columnwise  (clone(permute(data, [1, 0])), scale_inv)      tensorwise: the bytes transposed
    columnwise  (clone(permute(data, [1, 0])),                 blockwise (128x128 tiles): the
                 clone(permute(scale_inv, [1, 0])))             bytes and the tile scales transposed

which are the bits the quantize would give: the gathered bytes are the weight quantized with
the whole weight's amax (tensorwise: one scale, an elementwise cast), or each 128x128 tile with
its own amax (blockwise: the tiles of w.t() are those of w transposed). A quantize under another
recipe than the gathered one, a graph that reads the value otherwise (a GEMM kept in high
precision, a non-GEMM op) would read a dequantized weight: that is a ValueError naming the
weight and the reader, never a silently different number.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from ..config import Config
from ..decisions import Decision, Plan, Quantized, What, record
from ..fp8 import recipes
from ..fp8.fsdp import FSDP_FP8_WEIGHT
from ..fp8.ops import QUANTIZE
from ..graph.joint import (FSDP_FP8_BLOCK_SCALES, FSDP_FP8_DATA, FSDP_FP8_SCALE,
                           partition_side, set_partition_side)
from ..graph.nodes import module_path, op_name, replace_tuple_node
from .partitioner import TrialPartitioner

_LAYOUT = ("aten.permute", "aten.t", "aten.view", "aten.reshape", "aten._unsafe_view")


def fsdp_fp8_weights(joint: fx.GraphModule, plan: Plan, config: Config,
                     partitioner: TrialPartitioner) -> None:
    graph = joint.graph
    weights = [n for n in graph.nodes if n.op == "call_function" and n.target is FSDP_FP8_WEIGHT]
    for value in weights:
        data, scale_inv, _, gathered_recipe = value.args[:4]
        scale_inv.meta[FSDP_FP8_SCALE] = True
        data.meta[FSDP_FP8_DATA] = True
        readers = [u for u in value.users if _live(u)]
        others = [u for u in readers if not _quantize_of(u, gathered_recipe)]
        where = next((module_path(u) for u in readers if module_path(u)), "") or data.name
        if others:
            raise ValueError(
                f"graphpass: the weight of {where} arrives all-gathered in FP8 by FSDP2 "
                f"(graphpass.fsdp_fp8_weights), and this graph reads its value with "
                f"{', '.join(sorted({op_name(u) for u in others}))} (graphpass's FP8 GEMMs "
                "read the gathered bytes only; a linear fp8_exclude or the FP8 lowering keeps "
                "in high precision needs the weight itself): give fsdp_fp8_weights the same "
                "config as the backend, and name such a linear in its fp8_exclude")
        blocks = not recipes.get_recipe(gathered_recipe).per_tensor
        if blocks:
            data.meta[FSDP_FP8_BLOCK_SCALES] = tuple(scale_inv.meta["val"].shape)
        for q in readers:
            _replace(graph, q, data, scale_inv, blocks)
        _erase_dead(graph, value)
        gathered = data.meta["val"]
        how = ("with the 128x128 tile scales of its shards, gathered beside it; dgrad's "
               "columnwise copy is the gathered data and scales transposed" if blocks else
               "with the whole weight's scale")
        plan.decide(Decision(What.FP8_ALL_GATHER, "fp8", (
            f"weight, FSDP2: all-gathered in FP8 ({_dtype(gathered)}, {how}); the FP8 GEMMs "
            "read the gathered bytes, no quantize in the graph"), where), once=True)
    if weights:
        graph.lint()
        joint.recompile()


def _live(node: fx.Node) -> bool:
    """Read by something: not a layout op, or a layout op that is (the lowering leaves the
    weight's transposes behind, read by nothing)."""
    return op_name(node) not in _LAYOUT or any(_live(u) for u in node.users)


def _erase_dead(graph: fx.Graph, node: fx.Node) -> None:
    for user in list(node.users):
        _erase_dead(graph, user)
    graph.erase_node(node)


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _quantize_of(node: fx.Node, gathered: str) -> bool:
    """A quantize of the weight, as lower_fp8 writes it, under the recipe it was gathered in
    (its quantization: scales, dtype; the accumulation is the GEMM's)."""
    if node.target is not QUANTIZE or len(node.args) != 4 or node.args[2] != "weight":
        return False
    return (recipes.get_recipe(node.args[1]).quantization_key
            == recipes.get_recipe(gathered).quantization_key)


def _replace(graph: fx.Graph, q: fx.Node, data: fx.Node, scale_inv: fx.Node,
             blocks: bool) -> None:
    usage = q.args[3]
    outputs: dict[int, fx.Node] = {}
    if usage in ("rowwise", "both"):
        outputs[0], outputs[1] = data, scale_inv
    if usage in ("columnwise", "both"):
        quantized = Quantized("weight", True, data, q.args[1])
        col = _transposed(graph, q, data, quantized)
        col_scale = scale_inv
        if blocks:  # the tiles of w.t() are w's transposed, with the same scales
            col_scale = _transposed(graph, q, scale_inv, quantized)
            record(col_scale, fp8_scale=True)
        first = 2 if usage == "both" else 0
        outputs[first], outputs[first + 1] = col, col_scale
    replace_tuple_node(graph, q, outputs)


def _transposed(graph: fx.Graph, q: fx.Node, x: fx.Node, quantized: Quantized) -> fx.Node:
    """A contiguous copy of 2-D ``x`` transposed, before ``q`` and in its module and side."""
    with graph.inserting_before(q):
        # permute, not t: the graphs Inductor lowers have t decomposed already
        t = graph.call_function(torch.ops.aten.permute.default, (x, [1, 0]))
        col = graph.call_function(torch.ops.aten.clone.default, (t,),
                                  {"memory_format": torch.contiguous_format})
    t.meta["val"] = x.meta["val"].permute(1, 0)
    col.meta["val"] = t.meta["val"].contiguous()
    for node in (t, col):
        for key in ("nn_module_stack", "fwd_nn_module_stack", "seq_nr", "stack_trace"):
            if key in q.meta:
                node.meta[key] = q.meta[key]
        if partition_side(q) is not None:
            set_partition_side(node, partition_side(q))
        record(node, quantized=quantized)
    return col
