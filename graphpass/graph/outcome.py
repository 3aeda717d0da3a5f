"""What the partition did, read back from its forward and backward graphs."""

from __future__ import annotations

import dataclasses

import torch.fx as fx

from .. import _compat
from ..decisions import Decision, What, facts
from .flops import node_flops
from .joint import Side, in_user_checkpoint, partition_side
from .nodes import module_path, op_name
from .ops import BOOKKEEPING


def outcome_notes(fw: fx.GraphModule, bw: fx.GraphModule, *,
                  num_fwd_outputs: int) -> tuple[list[Decision], int]:
    """Decisions on recomputed modules and re-quantized originals, and the recompute FLOPs.

    Nodes that came from the forward but run in the backward are the recomputed ones; the
    partitioner copies them with their metadata, ``partitioner_tag`` included.
    """
    recomputed: dict[str, tuple[Decision, set[str]]] = {}
    requantized: list[str] = []
    flops = 0
    for node in bw.graph.nodes:
        if op_name(node) == "higher_order.run_with_rng_state":
            # an op torch treats as random (attention), rebuilt by the partitioner without our
            # metadata: name it by its op and by the module of the tensors it reads
            op = next(a for a in node.args if _compat.is_op_overload(a))
            module = next((module_path(a) for a in node.args[2:] if isinstance(a, fx.Node)), "")
            replayed = Decision(What.RECOMPUTED, "partitioner", f"{op.name()} under its saved RNG state")
            recomputed.setdefault(replayed.why, (replayed, set()))[1].add(module or "(top level)")
            flops += node_flops(node)
            continue
        side = partition_side(node)
        if node.op != "call_function" or side not in (Side.FORWARD, Side.MUST_BE_IN_BACKWARD):
            continue
        quantized = facts(node).quantized
        if (quantized is not None and op_name(node) == "graphpass.quantize" and quantized.columnwise
                and quantized.role == "input"):
            requantized.append(module_path(node))
        if side is Side.FORWARD:
            flops += node_flops(node)
            decision = recompute_decision(node)
            if op_name(node) not in BOOKKEEPING and decision.what is What.RECOMPUTED:
                recomputed.setdefault(decision.why, (decision, set()))[1].add(
                    module_path(node) or "(top level)")
    notes = [Decision(What.REQUANTIZED, "save original", module=m)
             for m in dict.fromkeys(requantized)]
    notes += [Decision(What.RECOMPUTED_IN_BACKWARD, decision.by, decision.why, ", ".join(sorted(mods)))
              for decision, mods in recomputed.values()]
    return notes, flops


def weight_once_outcome(decisions: list[Decision], bw: fx.GraphModule) -> list[Decision]:
    """``decisions`` with each ``fp8_save_quantized_weight`` note of a weight whose quantize of both usages
    the backward recomputes (a recompute selection took it, or the memory budget, or your
    checkpoint) saying so: its note, written before those passes, says dgrad's copy is saved,
    and the partition saves nothing of it."""
    head = "the weight's two FP8 copies quantized in the forward, from one read"
    why: dict[str, str] = {}
    for node in bw.graph.nodes:
        if (node.op == "call_function"
                and op_name(node) in ("graphpass.quantize", "graphpass.quantize_weight")
                and partition_side(node) is Side.FORWARD and len(node.args) >= 4
                and node.args[2] == "weight" and node.args[3] == "both"
                and isinstance(node.args[0], fx.Node) and node.args[0].op == "placeholder"):
            why[node.args[0].name] = (
                f"{head}, and again in the backward ({recompute_decision(node).by}): dgrad's "
                "copy recomputed, not saved" if op_name(node) == "graphpass.quantize" else
                f"{head} once per optimizer step (fp8_weight_cache), looked up by the backward: "
                "dgrad's copy held by the cache, not saved")
    return [dataclasses.replace(d, why=why[d.node])
            if d.what is What.WEIGHT_ONCE and d.node in why else d for d in decisions]


def recompute_decision(node: fx.Node) -> Decision:
    """Why a forward node is recomputed (or kept saved): a pass's decision, else the user's
    checkpoint region, else torch's min-cut's own choice."""
    decision = facts(node).recompute
    if decision is not None:
        return decision
    if in_user_checkpoint(node):
        return Decision(What.RECOMPUTED, "your checkpoint", "your checkpoint", node=node.name)
    return Decision(What.RECOMPUTED, "partitioner", "partitioner's choice", node=node.name)


def rng_state_decision(run_and_save: fx.Node) -> Decision:
    """The decision for the RNG state torch saves for a recomputed random op (the forward's
    ``run_and_save_rng_state``; its output, item 1, keeps the op's metadata)."""
    output = next((u for u in run_and_save.users if u.args[1] == 1), run_and_save)
    decision = recompute_decision(output)
    return dataclasses.replace(decision, why=f"{decision.why} (replayed under this RNG state)")
