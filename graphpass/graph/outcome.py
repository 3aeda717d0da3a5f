"""What the partition did, read back from its forward and backward graphs."""

from __future__ import annotations

import torch
import torch.fx as fx

from .flops import node_flops
from .nodes import module_path, op_name


# Ops too cheap to mention when they are recomputed: views, casts, tuple access.
_BOOKKEEPING = ("getitem", "aten.view", "aten.permute", "aten.t", "aten.expand", "aten.reshape",
                "aten._unsafe_view", "aten.unsqueeze", "aten.squeeze", "aten.slice", "aten.select",
                "aten.transpose", "aten.alias", "prims.convert_element_type", "aten.clone")


def outcome_notes(fw: fx.GraphModule, bw: fx.GraphModule, *,
                  num_fwd_outputs: int) -> tuple[list[str], int]:
    """Notes on recomputed modules and re-quantized originals, and the recompute FLOPs.

    Nodes that came from the forward but run in the backward are the recomputed ones; the
    partitioner copies them with their metadata, ``partitioner_tag`` included.
    """
    recomputed: dict[str, set[str]] = {}
    requantized: list[str] = []
    flops = 0
    for node in bw.graph.nodes:
        if op_name(node) == "higher_order.run_with_rng_state":
            # an op torch treats as random (attention), rebuilt by the partitioner without our
            # metadata: name it by its op and by the module of the tensors it reads
            op = next(a for a in node.args if isinstance(a, torch._ops.OpOverload))
            module = next((module_path(a) for a in node.args[2:] if isinstance(a, fx.Node)), "")
            recomputed.setdefault(f"recomputed: {op.name()} under its saved RNG state", set()).add(
                module or "(top level)")
            flops += node_flops(node)
            continue
        if node.op != "call_function" or node.meta.get("partitioner_tag") not in (
                "is_forward", "must_be_in_backward"):
            continue
        fp8 = node.meta.get("graphpass_fp8")
        if fp8 and op_name(node) == "graphpass.quantize" and fp8.get("columnwise") and (
                fp8.get("role") == "input"):
            requantized.append(module_path(node) or "<root>")
        if node.meta.get("partitioner_tag") == "is_forward":
            flops += node_flops(node)
            reason = node.meta.get("graphpass_recompute", "recomputed: your checkpoint"
                                   if "ac_graph_id" in node.meta else "recomputed: partitioner's choice")
            if op_name(node) not in _BOOKKEEPING and not reason.startswith("saved"):
                recomputed.setdefault(reason, set()).add(module_path(node) or "(top level)")
    notes = [f"save original: {m} re-quantizes its saved input in the backward"
             for m in dict.fromkeys(requantized)]
    notes += [f"{reason} in backward: {', '.join(sorted(mods))}" for reason, mods in recomputed.items()]
    return notes, flops
