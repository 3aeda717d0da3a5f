"""torch's min-cut partitioner under the passes' tags, weighing recomputed random ops.

torch recomputes an op it treats as random (attention, dropout) under an RNG state it saves for
it (on CPU a 5 KB generator state), which its min-cut does not cost and which can outweigh the
outputs the recompute discards. Where the user's recompute selection includes such ops, the
joint graph is partitioned a second time with them kept saved, and the plan that saves fewer
bytes is used.
"""

from __future__ import annotations

import operator
import re
from typing import Any, Callable, Sequence

import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from . import _compat
from .config import Config
from .decisions import Decision, Plan, What, facts
from .fp8.inductor import quantize_code
from .graph.backward_order import order_for_memory
from .graph.nodes import is_backward, module_path, op_name
from .graph.offload_copies import partition_windows
from .graph.peak import step_peak
from .passes.partitioner import PeakPrediction, Saves
from .passes.tags import random_recomputes, tag
from .report import Report

Partitioned = tuple[fx.GraphModule, fx.GraphModule]


def min_cut(
    joint: fx.GraphModule,
    joint_inputs: Sequence[Any],
    *,
    plan: Plan,
    config: Config,
    saved: Callable[[fx.GraphModule, fx.GraphModule], Report],
    **partitioner_args: Any,
) -> Partitioned:
    """torch's min-cut of ``joint`` (``partitioner_args``: ``num_fwd_outputs``,
    ``static_lifetime_input_indices``, ``compiler``); ``saved`` reports what a partition saves,
    to weigh the two plans where random ops are selected for recompute."""
    def partition(graph: fx.GraphModule) -> Partitioned:
        return _partition(graph, joint_inputs, plan=plan, config=config, **partitioner_args)

    random = random_recomputes(joint)
    if not random:
        return _note_order(plan, partition(joint), config)
    keeping = _keeping_saved(joint, random)  # copy first: torch's partitioner edits its graph
    recomputing, kept = partition(joint), partition(keeping)
    recomputing_saved = saved(*recomputing)
    more = recomputing_saved.activation_bytes - saved(*kept).activation_bytes
    if more <= 0:
        return _note_order(plan, recomputing, config)
    rng = recomputing_saved.bytes_by("kind").get("rng_state", 0)
    ops = sorted({f"{op_name(n)} in {module_path(n) or '(top level)'}" for n in random})
    plan.decide(Decision(What.KEPT_SAVED, "recompute", (
        f"{', '.join(ops)}; recomputing would save their RNG state ({rng:,} B) and {more:,} B "
        "more in all")))
    return _note_order(plan, kept, config)


def _partition(graph: fx.GraphModule, joint_inputs: Sequence[Any], *, plan: Plan, config: Config,
               **partitioner_args: Any) -> Partitioned:
    on_cuda = _on_cuda(plan)
    offload = config.offload or bool(plan.torch_offloading)  # the memory budget may offload alone
    with _compat.min_cut_settings(relaxed=config.memory_policy == "auto", offload=offload,
                                  offload_stream=offload and config.offload_stream is not False
                                  and on_cuda), _compat.min_cut_dumps() as dumps:
        names = {n.name: n for n in graph.graph.nodes}  # torch's partitioner edits the graph
        try:
            fw, bw = _compat.min_cut_partition(graph, joint_inputs, **partitioner_args)
        except Exception as e:
            if not _compat.min_cut_failure(e):
                raise
            raise PartitionError(_failure(names, config, e, dumps.directory)) from e
    if config.codegen == "inductor" and config.order_backward and not on_cuda:
        bw.meta[_ORDERED] = order_for_memory(bw)  # every partition: the peak predicted follows
    return fw, bw


_ORDERED = "graphpass_backward_order"


def _on_cuda(plan: Plan) -> bool:
    """Whether the joint graph's inputs are CUDA tensors: its graphs are compiled for a GPU."""
    return any(getattr(p.meta.get("val"), "is_cuda", False) for p in plan.primals)


def _note_order(plan: Plan, partitioned: Partitioned, config: Config) -> Partitioned:
    """The report's notes of ``order_backward``: on a GPU, what Inductor's code of an FP8
    backward does (``fp8/gemm_order.py``, which the step-peak model follows); elsewhere, what
    ``order_for_memory`` moved in the backward kept."""
    if config.codegen == "inductor" and config.order_backward and config.recipe is not None \
            and _on_cuda(plan):
        plan.decide(Decision(What.BACKWARD_ORDER, "order_backward", (
            "on a GPU each FP8 GEMM's operand copies are made after the GEMM before it in the "
            "graph's order (control dependencies Inductor's scheduler keeps), each gradient "
            "quantized from a buffer of its own: Inductor's CUDA code of the Llama-3-8B FP8 "
            "tensorwise layer holds 913 against 1,201 MiB above weights, inputs and gradients, "
            "for about 20% more bytes moved by its kernels, and the predicted step peak, which "
            "follows that order, was 5% above that code's (not yet measured on a GPU: "
            "docs/memory/order-backward.md)")), once=True)
    for moved in partitioned[1].meta.get(_ORDERED, ()):
        names = [f"{n} ({m})" for n, m in zip(moved.reductions, moved.modules)]
        released = ", ".join(moved.released[:4]) + (", ..." if len(moved.released) > 4 else "")
        waited = (f"the {moved.kernels} kernels that waited for them ({released}) run"
                  if moved.kernels > 1 else f"the kernel that waited for them ({released}) runs")
        plan.decide(Decision(What.BACKWARD_ORDER, "order_backward", (
            f"{', '.join(names)}, which Inductor runs as one kernel, moved to follow "
            f"{moved.after}, the last buffer they read; {waited} in the graph's order")))
    return partitioned


class PartitionError(RuntimeError):
    """torch's min-cut could not partition a joint graph under graphpass's tags. The first line
    names the modules, the options and the policy of the nodes involved; torch's own message
    follows."""


# torch's message lists the nodes of the path it could not cut, one per line: "  <name>:".
_CONFLICT_NODE = re.compile(r"^  (\w+):$", re.MULTILINE)


def _failure(names: dict[str, fx.Node], config: Config, error: BaseException,
             directory: str | None) -> str:
    """The message of a failed min-cut: one line naming the modules, the options and the
    policy of each node torch lists as involved (else of every node graphpass tagged), then
    torch's message."""
    text = str(error)
    involved = [names[m] for m in dict.fromkeys(_CONFLICT_NODE.findall(text)) if m in names]
    nodes = involved or [n for n in names.values() if n.meta.get("recompute") is not None]
    modules = ", ".join(dict.fromkeys(module_path(n) or "<root>" for n in nodes)) or "<root>"

    policies: dict[str, list[str]] = {}  # "MUST_RECOMPUTE by recompute mlp": node names
    for node in nodes:
        tagged, decision = node.meta.get("recompute"), facts(node).recompute
        by = decision.by if decision is not None else "your checkpoint policy"
        key = f"{getattr(tagged, 'name', tagged)} by {by}" if tagged is not None else "untagged"
        policies.setdefault(key, []).append(node.name)
    shown = "; ".join(f"{key} ({len(names)} node(s): {', '.join(names[:4])}"
                      + (", ...)" if len(names) > 4 else ")") for key, names in policies.items())
    options = ", ".join(f"{k}={v!r}" for k, v in config.changed().items())
    dumped = (f"; torch's debug files are in {directory}" if directory
              else "; torch wrote no debug files")
    first = (f"graphpass could not partition the graph of {modules} under "
             f"graphpass.backend({options}): torch's min-cut found a value the backward needs "
             f"that can be neither saved nor recomputed (policy: {shown or 'no node tagged'})"
             f"{dumped}")
    return f"{first}\n\n{type(error).__name__}: {text}"


_JOINT_NODE = "graphpass_joint_node"


def _partition_marked(joint: fx.GraphModule, joint_inputs: Sequence[Any], *, plan: Plan,
                      config: Config, **partitioner_args: Any
                      ) -> tuple[fx.GraphModule, fx.GraphModule]:
    """torch's min-cut of a copy of ``joint``, each node of the two graphs carrying the joint
    node it comes from in ``meta[_JOINT_NODE]`` (torch copies node metadata into both graphs)."""
    for node in joint.graph.nodes:
        node.meta[_JOINT_NODE] = node
    try:
        return _partition(_copy(joint), joint_inputs, plan=plan, config=config,
                          **partitioner_args)
    finally:
        for node in joint.graph.nodes:
            node.meta.pop(_JOINT_NODE, None)


class TrialMinCut:
    """The passes' :class:`~graphpass.passes.partitioner.TrialPartitioner` of one joint graph:
    torch's min-cut of a copy of it as tagged, under the settings of the final partition."""

    def __init__(self, joint_inputs: Sequence[Any], *, plan: Plan, config: Config,
                 **partitioner_args: Any) -> None:
        self.joint_inputs, self.plan, self.config = joint_inputs, plan, config
        self.partitioner_args = partitioner_args

    def saves(self, joint: fx.GraphModule) -> Saves:
        return exact_partition(joint, self.joint_inputs, plan=self.plan, config=self.config,
                               **self.partitioner_args)

    def predict_peak(self, joint: fx.GraphModule) -> PeakPrediction:
        return partition_peak(joint, self.joint_inputs, plan=self.plan, config=self.config,
                              **self.partitioner_args)


def exact_partition(joint: fx.GraphModule, joint_inputs: Sequence[Any], *, plan: Plan,
                    config: Config, **partitioner_args: Any) -> Saves:
    """torch's min-cut of a copy of ``joint`` as tagged so far: the joint nodes the forward
    saves, and the joint forward nodes the backward recomputes (``TrialMinCut.saves``).
    Each joint node is found through a metadata key, which torch copies into both graphs."""
    fw, bw = _partition_marked(joint, joint_inputs, plan=plan, config=config, **partitioner_args)
    outputs = fw.graph.find_nodes(op="output")[0].args[0]
    num_fwd_outputs = partitioner_args["num_fwd_outputs"]
    saved = [n.meta[_JOINT_NODE] for n in outputs[num_fwd_outputs:]
             if isinstance(n, fx.Node) and _JOINT_NODE in n.meta]
    recomputed = {n.meta[_JOINT_NODE] for n in bw.graph.nodes
                  if n.op == "call_function" and _JOINT_NODE in n.meta
                  and not is_backward(n.meta[_JOINT_NODE])}
    return Saves(saved, recomputed)


def partition_peak(joint: fx.GraphModule, joint_inputs: Sequence[Any], *, plan: Plan,
                   config: Config, **partitioner_args: Any) -> PeakPrediction:
    """torch's min-cut of a copy of ``joint`` as tagged so far: the step's predicted peak
    (``graph/peak.py``), the joint nodes it saves, by the name the forward gives them, and the
    compute each saved tensor's copies to the host could hide under
    (``TrialMinCut.predict_peak``)."""
    fw, bw = _partition_marked(joint, joint_inputs, plan=plan, config=config, **partitioner_args)
    num_fwd_outputs = partitioner_args["num_fwd_outputs"]
    outputs = fw.graph.find_nodes(op="output")[0].args[0]
    saved = {n.name: n.meta[_JOINT_NODE] for n in outputs[num_fwd_outputs:]
             if isinstance(n, fx.Node) and _JOINT_NODE in n.meta}
    with quantize_code(config):
        peak = step_peak(fw, bw, num_fwd_outputs=num_fwd_outputs,
                         parameter_names={p.name for p in plan.parameters},
                         runtime=config.codegen)
    return PeakPrediction(peak, saved, partition_windows(fw, bw))


def _copy(joint: fx.GraphModule) -> fx.GraphModule:
    """A copy of the joint graph, metadata copied per node."""
    graph = fx.Graph()
    graph._codegen = joint.graph._codegen
    graph.output(graph.graph_copy(joint.graph, {}))
    copy = fx.GraphModule(joint, graph)
    copy.meta.update(joint.meta)
    return copy


def _keeping_saved(joint: fx.GraphModule, nodes: list[fx.Node]) -> fx.GraphModule:
    """A copy of the joint graph (metadata copied per node) with ``nodes`` kept saved."""
    copy = _copy(joint)
    graph = copy.graph
    # a multi-output op is saved through its getitems (torch saves tensors, not tuples)
    names = {n.name for n in nodes} | {u.name for n in nodes for u in n.users
                                        if u.target is operator.getitem}
    for node in graph.nodes:
        if node.name in names:
            tag(node, CheckpointPolicy.MUST_SAVE, Decision(
                What.SAVED, "recompute", "recomputing it would save more", node=node.name))
    return copy
