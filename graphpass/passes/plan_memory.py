"""The memory planner (``memory="auto"``): fewest saved bytes within a recompute budget.

torch's min-cut already minimises saved bytes, counting each value once in its real dtype (1 byte
for FP8); its defaults only forbid far more recompute than needed (reductions, ops outside an
allowlist, long fusible chains). The planner replaces those heuristics by one rule: GEMMs,
attention and random ops are never recomputed unless the user selected their module; every other
op may be, as long as everything that could be recomputed costs at most ``recompute_budget`` of the
step's FLOPs. torch's min-cut then picks, per saved tensor, between saving it (in FP8 or in the
original dtype) and recomputing it; the pipeline relaxes torch's heuristics around that call.
"""

from __future__ import annotations

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from ..config import Config
from ..decisions import Decision, Plan, What
from ..graph.flops import node_flops, step_flops
from ..graph.nodes import is_random
from ..graph.regions import forward_calls, is_expensive
from .partitioner import TrialPartitioner
from .tags import overruled_by_user, tag, user_policy


def plan_memory(joint: fx.GraphModule, plan: Plan, config: Config,
                partitioner: TrialPartitioner) -> None:
    if config.memory_policy != "auto":
        return
    candidates = []
    overruled = []
    for node in forward_calls(joint):
        if "recompute" in node.meta:  # a recompute selection, a boundary or the user's checkpoint
            if (user_policy(node) not in (None, CheckpointPolicy.MUST_SAVE)
                    and (is_expensive(node) or is_random(node))):
                overruled.append(node)
            continue
        if is_expensive(node) or is_random(node):
            tag(node, CheckpointPolicy.MUST_SAVE)
        else:
            candidates.append(node)
    if overruled:
        plan.decide(overruled_by_user("planner", overruled, CheckpointPolicy.MUST_SAVE))
    if config.planner_recompute_budget is None:
        return
    step = step_flops(joint)
    budget = config.planner_recompute_budget * step
    cost = {n: node_flops(n) for n in candidates}
    total = sum(cost.values())
    # Everything left could be recomputed; if even that fits, the min-cut is free to choose.
    # Otherwise keep the costliest candidates saved until the worst case fits.
    for node in sorted(candidates, key=cost.__getitem__, reverse=True):
        if total <= budget:
            break
        tag(node, CheckpointPolicy.MUST_SAVE)
        total -= cost[node]
    plan.decide(Decision(What.BUDGET, "planner", f"{total / max(step, 1):.3%} of the step's FLOPs "
                         f"(budget {config.planner_recompute_budget:.1%})"))
