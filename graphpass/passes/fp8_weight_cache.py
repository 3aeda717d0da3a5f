"""Quantize each lowered weight once per optimizer step (``fp8_weight_cache``).

Every weight quantize of the forward whose input is a parameter becomes one
``graphpass::quantize_weight`` (``graphpass/fp8/weight_cache.py``): both of the weight's copies
(fprop's and dgrad's) from one read of the weight, kept by the cache until the parameter's
version changes, so with gradient accumulation the weight is read and quantized on the first
micro-batch after each optimizer step and looked up on the others. The node is tagged
must-recompute: the backward looks dgrad's copy up again instead of saving it, so the step saves
nothing for the weights and the copies live in the cache alone.

A memory decision: the cache holds 1 byte per element and copy (for a weight with dgrad, as
many bytes as the bf16 weight itself) between steps, which the report lists per weight and the
step peak counts (live kind ``cached``). Gradients are bit-identical to quantizing every
micro-batch: the copies are the same op's outputs. A weight quantize whose input is not a
parameter (an all-gathered or a computed weight) is left as it is, with a note.
"""

from __future__ import annotations

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..config import Config
from ..decisions import Decision, Plan, What
from ..fp8.ops import QUANTIZE
from ..fp8.weight_cache import QUANTIZE_WEIGHT
from ..graph.nodes import is_backward, module_path, tensor_bytes
from .save_original import merge_usages
from .tags import overruled_by_user, tag, user_policy

BY = "fp8_weight_cache"
_SAVED = (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE)


def fp8_weight_cache(joint: fx.GraphModule, plan: Plan, config: Config) -> None:
    if config.fp8 is None or not config.fp8_weight_cache:
        return
    weights: dict[fx.Node, dict[str, fx.Node]] = {}
    for node in joint.graph.nodes:
        if (node.target is QUANTIZE and not is_backward(node) and node.args[2] == "weight"
                and len(node.args) == 4):
            weights.setdefault(node.args[0], {})[node.args[3]] = node
    cached = 0
    overruled: list[fx.Node] = []
    for w, by_usage in weights.items():
        module = module_path(next(iter(by_usage.values())))
        shape = "x".join(map(str, w.meta["val"].shape))
        if w not in plan.parameters:
            plan.decide(Decision(What.WEIGHT_NOT_CACHED, BY, (
                f"the {shape} weight is not a parameter (a gathered or computed weight is new "
                "every step), so it is quantized every step"), module, w.name))
            continue
        if "rowwise" in by_usage and "columnwise" in by_usage:
            node = merge_usages(joint.graph, by_usage["rowwise"], by_usage["columnwise"])
        else:
            node = next(iter(by_usage.values()))
        if not tag(node, CheckpointPolicy.MUST_RECOMPUTE) and user_policy(node) in _SAVED:
            # the user's checkpoint policy saves it: a saved copy could be a donated buffer the
            # backward writes into, so this weight is quantized every step
            overruled.append(node)
            continue
        node.target = QUANTIZE_WEIGHT
        cached += 1
        nbytes = sum(tensor_bytes(v, where=f"{BY}'s size of {w.name}") for v in node.meta["val"])
        copies = "both FP8 copies" if node.args[3] == "both" else "its FP8 copy"
        plan.decide(Decision(What.WEIGHT_CACHED, BY, (
            f"the {shape} weight's {copies} quantized once per optimizer step and held between "
            f"steps ({nbytes:,} B)"), module, w.name))
    plan.count(BY, "weights", cached)  # none in any graph: an EmptySelectionWarning
    if overruled:
        plan.decide(overruled_by_user(BY, overruled, CheckpointPolicy.MUST_RECOMPUTE))
    joint.graph.lint()
    joint.recompile()
