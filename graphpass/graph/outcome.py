"""What the partition did, read back from its forward and backward graphs."""

from __future__ import annotations

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
        if node.op != "call_function" or node.meta.get("partitioner_tag") not in (
                "is_forward", "must_be_in_backward"):
            continue
        fp8 = node.meta.get("graphpass_fp8")
        if fp8 and op_name(node) == "graphpass.quantize" and fp8.get("columnwise"):
            requantized.append(module_path(node))
        if node.meta.get("partitioner_tag") == "is_forward":
            flops += node_flops(node)
            reason = node.meta.get("graphpass_recompute", "recomputed: partitioner's choice")
            if op_name(node) not in _BOOKKEEPING and not reason.startswith("saved"):
                recomputed.setdefault(reason, set()).add(module_path(node) or "(top level)")
    notes = [f"save original: {m} re-quantizes its saved input in the backward"
             for m in dict.fromkeys(requantized)]
    notes += [f"{reason} in backward: {', '.join(sorted(mods))}" for reason, mods in recomputed.items()]
    return notes, flops
