"""The graphpass partition: the passes in order, torch's min-cut, the report.

This is the one place where the pass order is written down.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Sequence

import torch.fx as fx

from . import _compat
from .config import Config, given
from .decisions import Decision, Plan, What
from .graph.joint import primals as primals_of, static_primal_positions
from .min_cut import TrialMinCut, min_cut
from .passes.canonicalize import canonicalize
from .passes.fp8_all_gather import fp8_all_gather
from .passes.fp8_cache import fp8_cache
from .passes.fp8_weight_all_gather import fp8_weight_all_gather
from .passes.fp8_weight_cache import fp8_weight_cache
from .passes.fsdp_fp8_weights import fsdp_fp8_weights
from .passes.lower_fp8 import lower_fp8
from .passes.memory_budget import memory_budget
from .passes.offload import offload, offload_hidden
from .passes.partitioner import TrialPartitioner
from .passes.plan_memory import plan_memory
from .passes.recompute import recompute
from .passes.regather import regather
from .passes.save_original import save_original
from .report import Report
from .reporting import ReportBuilder, last_report, remember

__all__ = ["PASSES", "Partition", "last_report", "partition", "run"]

# Each pass rewrites the joint graph or tags its nodes for torch's min-cut, and records the
# decisions a user should see; listed in the order they run. A pass that weighs its choices
# against torch's min-cut of the graph as tagged asks the partitioner it is handed; what it
# changes about how later partitions run is a field of the plan.
PASSES: tuple[Callable[[fx.GraphModule, Plan, Config, TrialPartitioner], None], ...] = (
    canonicalize, lower_fp8, fsdp_fp8_weights, save_original, fp8_weight_cache,
    # SimpleFSDP's weights first (one amax all-reduce for a graph's weights), then the
    # sequence-parallel inputs and gradients
    fp8_weight_all_gather, fp8_all_gather, recompute, offload,
    plan_memory,
    # exact, and weighed on torch's min-cut of the plan the passes above tagged
    regather,
    # lossy and opt-in: after the exact passes, FP8 copies of what their plan still saves
    fp8_cache,
    # with offload_hidden_only: of the offloads, keep those whose copies hide under the compute
    # of the plan above
    offload_hidden,
    # exact: recompute or offload what the plan above still saves until its peak fits
    memory_budget)


class Partition(NamedTuple):
    forward: fx.GraphModule
    backward: fx.GraphModule
    report: Report | None
    """None when ``config.report`` is off."""
    selected: dict[tuple[str, str], int] = {}
    """What each selection of the config found in this graph (``Plan.selected``)."""


def partition(
    joint_module: fx.GraphModule,
    joint_inputs: Sequence[Any],
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None = None,
    config: Config | None = None,
    compiler: str = "inductor",
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """A ``partition_fn`` for ``aot_function``/``aot_module`` and any joint fw+bw graph.

    Runs graphpass's passes on the joint graph, partitions it with torch's min-cut
    rematerialization partitioner (a second time, keeping the cheaper plan, where the user's
    recompute selection includes random ops such as attention or dropout), records the
    saved-tensor report (``graphpass.last_report()``) and returns the forward and backward
    modules in torch's layout.
    """
    fw, bw, report, _ = run(joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                            static_lifetime_input_indices=static_lifetime_input_indices,
                            config=given(config), compiler=compiler)
    if report is not None:
        remember(report)
    return fw, bw


def run(
    joint: fx.GraphModule,
    joint_inputs: Sequence[Any],
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None,
    config: Config,
    compiler: str,
    input_sources: Sequence[str | None] = (),
    fsdp: bool = False,
) -> Partition:
    """:func:`partition`, returning its report instead of keeping it; ``input_sources`` are the
    user's names of the graph inputs, for the report's parameter rows, ``fsdp`` whether any is a
    weight FSDP2 manages."""
    primals = primals_of(joint)
    # Positions among the primals: a DTensor parameter flattens into several (torch 2.13+).
    static = static_primal_positions(primals, list(static_lifetime_input_indices or []))
    plan = Plan(primals=primals, parameters={primals[i] for i in static})
    for unused in config.unused():
        plan.decide(Decision(What.UNUSED, "config", str(unused)))
    trials = TrialMinCut(joint_inputs, plan=plan, config=config, num_fwd_outputs=num_fwd_outputs,
                         static_lifetime_input_indices=static, compiler=compiler)
    with _compat.assumed_sizes() as assumed:  # unbacked sizes that got a hint: a report note
        for graph_pass in PASSES:
            graph_pass(joint, plan, config, trials)
        builder = ReportBuilder(joint, plan, config, num_fwd_outputs=num_fwd_outputs)
        fw, bw = min_cut(joint, joint_inputs, plan=plan, config=config, saved=builder.saved,
                         num_fwd_outputs=num_fwd_outputs, static_lifetime_input_indices=static,
                         compiler=compiler)
        report = (builder.build(fw, bw, input_sources=input_sources, fsdp=fsdp, assumed=assumed)
                  if config.report else None)
    return Partition(fw, bw, report, plan.selected)
