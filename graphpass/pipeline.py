"""The graphpass partition: our passes on the joint graph, then torch's min-cut, then the report.

This is the one place where the pass order is written down.
"""

from __future__ import annotations

import contextlib
import contextvars
import operator
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

from . import _compat
from .config import Config, given
from .distributed import collective_notes, fp8_distributed_notes
from .fp8.inductor import INLINED_RECIPES, fusion_notes
from .graph.flops import step_flops
from .graph.gemms import coverage
from .graph.nodes import module_path, op_name
from .graph.outcome import outcome_notes
from .graph.saved import saved_rows
from .passes.canonicalize import canonicalize
from .passes.lower_fp8 import lower_fp8
from .passes.offload import offload
from .passes.plan_memory import plan_memory
from .passes.recompute import random_recomputes, recompute, tag
from .passes.save_original import save_original
from .report import Report, Row

# Each pass rewrites the joint graph or tags its nodes for torch's min-cut, and logs the
# decisions a user should see; listed in the order they run.
PASSES: tuple[Callable[[fx.GraphModule, Config, list[str]], None], ...] = (
    canonicalize, lower_fp8, save_original, recompute, offload, plan_memory)

_last_report: Report | None = None
_reports_sink: contextvars.ContextVar[list[Report] | None] = contextvars.ContextVar(
    "graphpass_reports", default=None
)
_input_sources: contextvars.ContextVar[Sequence[str | None]] = contextvars.ContextVar(
    "graphpass_input_sources", default=()
)
_fsdp_inputs: contextvars.ContextVar[bool] = contextvars.ContextVar("graphpass_fsdp_inputs",
                                                                   default=False)


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
    with _compat.assumed_sizes() as assumed:  # unbacked sizes that got a hint: a report note
        return _partition(joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                          static_lifetime_input_indices=static_lifetime_input_indices,
                          config=config, compiler=compiler, assumed=assumed)


def _partition(
    joint_module: fx.GraphModule,
    joint_inputs: Sequence[Any],
    *,
    num_fwd_outputs: int,
    static_lifetime_input_indices: list[int] | None = None,
    config: Config | None = None,
    compiler: str = "inductor",
    assumed: dict[str, list[str]],
) -> tuple[fx.GraphModule, fx.GraphModule]:
    config = given(config)
    primals = [n for n in joint_module.graph.find_nodes(op="placeholder") if "tangents" not in n.name]
    # Positions among the primals: a DTensor parameter flattens into several (torch 2.13+).
    static = _compat.static_primal_positions(primals, list(static_lifetime_input_indices or []))
    for i in static:
        primals[i].meta["graphpass_static"] = True
    log: list[str] = []
    for graph_pass in PASSES:
        graph_pass(joint_module, config, log)
    estimated: dict[str, str] = {}
    steps = step_flops(joint_module, estimated)
    fp8_coverage = coverage(joint_module) if config.fp8 else None
    on_cuda = any(getattr(p.meta.get("val"), "is_cuda", False) for p in primals)
    static_names = {primals[i].name for i in static if i < len(primals)}

    def min_cut(joint: fx.GraphModule) -> tuple[fx.GraphModule, fx.GraphModule]:
        with _compat.min_cut_settings(relaxed=config.memory_policy == "auto", offload=config.offload,
                                      offload_stream=config.offload_on_stream and on_cuda):
            return _compat.min_cut_partition(
                joint,
                joint_inputs,
                compiler=compiler,
                num_fwd_outputs=num_fwd_outputs,
                static_lifetime_input_indices=static,
            )

    def rows_of(fw: fx.GraphModule, bw: fx.GraphModule, sources: dict[str, str]) -> list[Row]:
        return saved_rows(fw, bw, num_fwd_outputs=num_fwd_outputs,
                          static_input_names=static_names, input_sources=sources)

    fw, bw = _min_cut_weighing_random_recomputes(
        joint_module, min_cut, lambda fw, bw: Report(rows=rows_of(fw, bw, {})), log)
    log += [f"flops: estimated as one per element for {op} ({why})" for op, why in estimated.items()]
    if config.codegen == "inductor" and config.fuse_quantize and config.fp8 in INLINED_RECIPES:
        log += fusion_notes(device_types={p.meta["val"].device.type for p in primals
                                          if isinstance(p.meta.get("val"), torch.Tensor)})
    if config.report:
        sources = list(_input_sources.get())
        # Dynamo's graph inputs: one per primal, or per DTensor two primals (torch 2.13+).
        index = _compat.primal_input_indices(primals)
        named = ({p.name: sources[i] for p, i in zip(primals, index) if i is not None}
                 if set(index) == set(range(len(sources))) else {})
        rows = rows_of(fw, bw, {k: v for k, v in named.items() if v})
        notes, recompute_flops = outcome_notes(fw, bw, num_fwd_outputs=num_fwd_outputs)
        notes += collective_notes(fw, bw)  # a tensor/sequence-parallel rank's communication
        if any(line.startswith("lowered:") for line in log):
            notes += fp8_distributed_notes(fw, bw, fsdp=_fsdp_inputs.get())
        report = Report(rows=rows, notes=log + notes + _compat.assumed_size_notes(assumed),
                        meta=_meta(config))
        report.meta.update(step_flops=steps, recompute_flops=recompute_flops)
        if fp8_coverage is not None:
            report.meta["fp8_coverage"] = fp8_coverage
        _record(report)
    return fw, bw


def _min_cut_weighing_random_recomputes(
    joint: fx.GraphModule,
    min_cut: Callable[[fx.GraphModule], tuple[fx.GraphModule, fx.GraphModule]],
    saved: Callable[[fx.GraphModule, fx.GraphModule], Report],
    log: list[str],
) -> tuple[fx.GraphModule, fx.GraphModule]:
    """torch's min-cut; where the user's selection recomputes random ops, the cheaper plan.

    torch recomputes a random op under an RNG state it saves for it (on CPU a 5 KB generator
    state), which can outweigh the outputs the recompute discards. Then the plan that keeps
    those ops' outputs saved is used instead, so recomputing them never costs bytes.
    """
    random = random_recomputes(joint)
    if not random:
        return min_cut(joint)
    keeping = _keeping_saved(joint, random)  # copy first: torch's partitioner edits its graph
    recomputing, kept = min_cut(joint), min_cut(keeping)
    recomputing_saved = saved(*recomputing)
    more = recomputing_saved.activation_bytes - saved(*kept).activation_bytes
    if more <= 0:
        return recomputing
    rng = recomputing_saved.bytes_by("kind").get("rng_state", 0)
    ops = sorted({f"{op_name(n)} in {module_path(n) or '(top level)'}" for n in random})
    log.append(f"recompute: kept saved, not recomputed: {', '.join(ops)}; recomputing would save "
               f"their RNG state ({rng:,} B) and {more:,} B more in all")
    return kept


def _keeping_saved(joint: fx.GraphModule, nodes: list[fx.Node]) -> fx.GraphModule:
    """A copy of the joint graph (metadata copied per node) with ``nodes`` kept saved."""
    graph = fx.Graph()
    graph._codegen = joint.graph._codegen
    graph.output(graph.graph_copy(joint.graph, {}))
    # a multi-output op is saved through its getitems (torch saves tensors, not tuples)
    names = {n.name for n in nodes} | {u.name for n in nodes for u in n.users
                                        if u.target is operator.getitem}
    for node in graph.nodes:
        if node.name in names:
            tag(node, CheckpointPolicy.MUST_SAVE, "saved: recomputing it would save more")
    copy = fx.GraphModule(joint, graph)
    copy.meta.update(joint.meta)
    return copy


def last_report() -> Report | None:
    """The report of the most recent partition in this process (``None`` before any)."""
    return _last_report


def _record(report: Report) -> None:
    global _last_report
    _last_report = report
    sink = _reports_sink.get()
    if sink is not None:
        sink.append(report)


@contextlib.contextmanager
def collect_reports() -> Iterator[list[Report]]:
    """Collect every report made inside the block (one per compiled graph)."""
    sink: list[Report] = []
    token = _reports_sink.set(sink)
    try:
        yield sink
    finally:
        _reports_sink.reset(token)


@contextlib.contextmanager
def input_sources(sources: Sequence[str | None], *, fsdp: bool = False) -> Iterator[None]:
    """Names of the graph inputs being compiled, so the report can name saved parameters, and
    whether any is a weight FSDP2 manages (all-gathered before the graph runs)."""
    token = _input_sources.set(tuple(sources))
    fsdp_token = _fsdp_inputs.set(fsdp)
    try:
        yield
    finally:
        _fsdp_inputs.reset(fsdp_token)
        _input_sources.reset(token)


def _meta(config: Config) -> dict[str, Any]:
    from . import __version__

    return {"graphpass": __version__, "torch": _compat.TORCH_VERSION_STR, "config": config.as_dict()}
